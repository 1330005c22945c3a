"""Repeated blocks compiled once (``KERAS_DTENSOR_FIX_COMPILE=blocks``).

A compiled step traces every decoder block of a model again, although all
run the same code: its start grows with the depth. In blocks mode the step
runs eagerly, as upstream runs it, and each repeated block (the outermost
layers with sublayers whose class the model holds at least twice: keras-hub's
decoder blocks) calls one ``torch.compile``'d function shared by every
instance of its class. dynamo traces it once and guards on what the instances
share (their shapes, placements and settings), so every block runs the same
graph, as torchtitan compiles one transformer block at a time.

Two things would make each instance a graph of its own:

- Keras's name scope: each sublayer's call pushes its name and reads the
  path of the layers around it. Inside a region the scope is skipped
  (:func:`name_scope`) and the path is empty; within a step a path decides
  only an output's layout (a LayoutMap key ``<path>/output``), so a block with
  such a layout inside it is not compiled (:func:`refusal`).
- Megatron's "f" (:func:`~keras_dtensor_fix.dtensor.reducing_gradient`)
  keeps its op on the value it reads: set inside a region on the block's
  input, a tensor from outside the graph, it is an extra output that gets no
  gradient. The region's first op instead is the "f" of each DTensor input
  (:func:`_with_f`), kept on its own in-graph result, which the block reads:
  its all-reduce runs in the block's backward graph, not eagerly between two
  graphs with a DTensor wrapped around it. Where that graph fails to compile,
  the "f" is made before the region, eagerly (warned).

Outside training (``torch.no_grad``: evaluation, prediction, generation),
inside a compiled step, without a ModelParallel distribution and in Keras's
symbolic calls the block's own ``call`` runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import types
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree

from keras_dtensor_fix.compiled import cache_key
from keras_dtensor_fix.compiled.steady import Steady, code_of
from keras_dtensor_fix.dtensor import (
    DTensor,
    reducing_gradient,
    reducing_input,
    zero_gradients_if_unused,
)
from keras_dtensor_fix.engine import state, targets
from keras_dtensor_fix.ops.values import flatten_call, output_laid_out

#: True while a block's region runs: its sublayers open no name scope.
REGION: list[bool] = []
#: Distribution -> (block class, the user's cache key tag) -> the class's compiled
#: ``call`` (a :class:`Steady`), shared by every instance (the process-keyed tag
#: made once, not per call).
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Block classes whose compilation failed: they run eagerly from then on.
_FAILED: set[type] = set()
#: The attribute marking a block whose ``call`` this module installed.
_INSTALLED = "_keras_dtensor_fix_block"
#: Model -> its blocks routed through a region.
_ROUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def repeated(model: Any) -> list[Any]:
    """The model's repeated blocks, outermost first, in the model's order.

    Layers with sublayers whose class occurs at least twice, not nested in
    another such layer; models (a functional backbone) are never blocks.
    """
    model_class = targets.keras_object("Model")
    layers = list(model._flatten_layers(include_self=False, recursive=True))
    composite = [
        layer
        for layer in layers
        if not isinstance(layer, model_class)
        and any(True for _ in layer._flatten_layers(include_self=False))
    ]
    counts = Counter(type(layer) for layer in composite)
    candidates = [layer for layer in composite if counts[type(layer)] >= 2]
    inner = {
        id(sub)
        for layer in candidates
        for sub in layer._flatten_layers(include_self=False, recursive=True)
    }
    return [layer for layer in candidates if id(layer) not in inner]


def refusal(block: Any) -> str | None:
    """Why ``block`` cannot run as its class's shared graph, or None."""
    if getattr(block, "_remat_mode", None) is not None:
        return "it is rematerialized"
    if getattr(block, "quantization_mode", None) is not None:
        return "it is quantized"
    distribution = targets.keras_object("distribution")()
    if distribution is not None and distribution.get_tensor_layout("/output"):
        return "the LayoutMap lays out the path '/output'"
    for layer in block._flatten_layers(include_self=False, recursive=True):
        if output_laid_out(layer):
            return f"the LayoutMap lays out {layer.path}/output"
        if getattr(layer, "activity_regularizer", None) is not None:
            return f"{layer.name} has an activity regularizer"
    return None


def choose(model: Any, mode: str) -> tuple[str, str]:
    """Which compilation ``model``'s steps get, ``step`` or ``blocks``, and why.

    ``mode`` is the configured one (``engine/config.compile_mode``). ``auto``
    compiles block by block where the model repeats blocks and none is
    refused: a training step faster than eager and close to the whole step's,
    and each block compiled once whatever the depth (figures:
    ``benchmarks/README.md``). Evaluation and prediction then compile whole
    (the ``compile`` family: a forward graph); in ``blocks`` mode they run
    eagerly (their blocks run without gradients: the block's own call).
    """
    if mode != "auto":
        return mode, f"KERAS_DTENSOR_FIX_COMPILE={mode}"
    found = repeated(model)
    if not found:
        return "step", "the default: the model repeats no block"
    for block in found:
        reason = refusal(block)
        if reason is not None:
            return "step", f"the default: block {block.name} cannot ({reason})"
    counts = Counter(type(block).__name__ for block in found)
    named = ", ".join(f"{count} {name}" for name, count in counts.items())
    return "blocks", (
        f"the default for repeated blocks ({named}); "
        "KERAS_DTENSOR_FIX_COMPILE=step compiles the whole step"
    )


#: How the last step built compiles, and why (``status()``'s notes).
LAST: list[str] = []


def tell(model: Any, building: str | None, mode: str, why: str) -> None:
    """Log once which compilation a step got (``mode``) and why."""
    if mode == "step" and why.endswith("=blocks"):
        why += ", but the model repeats no block it can compile alone"
    how = "block by block" if mode == "blocks" else "as a whole"
    what = (building or "make_train_function")[len("make_") : -len("_function")]
    line = f"{model.name}'s {what} step compiles {how}: {why}"
    if line not in LAST:
        logging.getLogger("keras_dtensor_fix").info("keras-dtensor-fix: %s", line)
    LAST[:] = [line]


def install(model: Any, failure: Callable[[BaseException], bool]) -> list[Any]:
    """Route each repeated block of ``model`` through its class's region.

    ``failure(error)`` says whether an error comes from torch.compile itself:
    that class then runs eagerly (warned). Returns the blocks routed; a block
    refused is named in one warning. Undone by deactivation.
    """
    routed, refused = [], []
    for by_class in _COMPILED.values():
        for compiled in by_class.values():
            compiled.reset()  # a new step: every block's guards run again
    for block in repeated(model):
        if getattr(block, _INSTALLED, False):
            routed.append(block)
            continue
        reason = refusal(block)
        if reason is not None:
            refused.append(f"{block.name} ({reason})")
            continue
        call = functools.partial(_region_call, block, type(block).call, failure)
        state.set_attribute(block, "call", call)
        state.set_attribute(block, _INSTALLED, True)
        routed.append(block)
    if routed:
        _ROUTED[model] = routed
    if refused:
        warnings.warn(
            "keras-dtensor-fix: KERAS_DTENSOR_FIX_COMPILE=blocks runs these "
            f"blocks eagerly: {'; '.join(refused[:4])}. A block is compiled once "
            "for every block of its class only where nothing depends on its "
            "sublayers' paths.",
            stacklevel=3,
        )
    return routed


def uninstall(model: Any) -> None:
    """Give the model's blocks their own ``call`` back (the mode or
    ``jit_compile`` changed before a step was built again)."""
    try:
        routed = _ROUTED.pop(model, ())
    except TypeError:  # an object no weak reference can hold: nothing routed
        return
    for block in routed:
        vars(block).pop("call", None)
        vars(block).pop(_INSTALLED, None)


def _region_call(
    block: Any,
    original: Callable[..., Any],
    failure: Callable[[BaseException], bool],
    *args: Any,
    **kwargs: Any,
) -> Any:
    cls = type(block)
    distribution = state.model_parallel()
    if (
        REGION
        or cls in _FAILED
        or not torch.is_grad_enabled()
        or state.compiling()
        or distribution is None
        or targets.keras_object("in_symbolic_scope")()
        or targets.keras_object("in_stateless_scope")()
    ):
        return original(block, *args, **kwargs)
    in_graph = IN_GRAPH_F and cls not in _EAGER_F
    if not in_graph:
        leaves, _ = flatten_call(args, kwargs)
        for value in leaves:
            if isinstance(value, DTensor):
                reducing_gradient(value)
    try:
        with region():
            compiled = _compiled(cls, original, distribution, in_graph)
            return _tangents_ready(compiled(block, *args, **kwargs))
    except Exception as error:
        if not failure(error):
            raise
        cause = failure_cause(error)
        if in_graph:  # again with the "f" eager; one warning whatever it gives
            _EAGER_F.add(cls)
            result = _region_call(block, original, failure, *args, **kwargs)
            if cls not in _FAILED:
                warnings.warn(
                    f"keras-dtensor-fix: torch.compile failed on {cls.__name__} "
                    f'({cause}); Megatron\'s "f" of its inputs runs eagerly '
                    "from now on.",
                    stacklevel=2,
                )
            return result
        _FAILED.add(cls)
        warnings.warn(
            f"keras-dtensor-fix: torch.compile failed on {cls.__name__} "
            f"({cause}); its blocks run eagerly from now on.",
            stacklevel=2,
        )
        return original(block, *args, **kwargs)


def failure_cause(error: BaseException) -> str:
    """``Type: first line`` of a compile failure's cause, for a warning
    (dynamo's BackendCompilerFailed holds the backend's own error)."""
    cause = getattr(error, "inner_exception", None) or error
    first = (str(cause).splitlines() or [""])[0][:200]
    return f"{type(cause).__name__}: {first}"


def _tangents_ready(result: Any) -> Any:
    """A region's outputs, each given a DTensor gradient where it gets none.

    A block that returns more than its hidden states (Gemma4's KV cache, in
    training too) leaves the rest without a gradient, and its graph's
    backward refused the plain zeros autograd filled them with (torch 2.13);
    the whole step then ran eagerly. One output passes as is.
    """
    leaves, spec = pytree.tree_flatten(result)
    if sum(isinstance(v, DTensor) and v.requires_grad for v in leaves) < 2:
        return result
    return pytree.tree_unflatten(zero_gradients_if_unused(leaves), spec)


@contextlib.contextmanager
def region() -> Iterator[None]:
    """Inside: no name scope is open, and sublayers open none."""
    stack = targets.keras_object("global_state").get_global_attribute(
        "name_scope_stack"
    )
    saved = list(stack) if stack else []
    if stack:
        stack.clear()
    REGION.append(True)
    try:
        yield
    finally:
        REGION.pop()
        if stack is not None:
            stack[:] = saved


def _compiled(
    cls: type, original: Callable[..., Any], distribution: Any, in_graph: bool
) -> Callable[..., Any]:
    user_tag = torch.compiler.config.cache_key_tag
    by_class = _COMPILED.setdefault(distribution, {})
    compiled = by_class.get((cls, user_tag, in_graph))
    if compiled is None:
        traced = _with_f(original) if in_graph else original
        # Every block of the class calls it in turn, once forward per step:
        # each block's guards run until a step of its calls compiles nothing.
        compiled = compile_region(traced, distribution, interleaved=True)
        by_class[(cls, user_tag, in_graph)] = compiled
    return compiled


def compile_region(
    traced: Callable[..., Any],
    distribution: Any,
    *,
    interleaved: bool = False,
    fixed: int = 0,
) -> Steady:
    """``traced`` as blocks mode compiles a region: static shapes (DTensor
    sharding propagation fails on symbolic sizes), the process-keyed cache
    tag, its guards skipped once settled (``fixed``: see ``Steady``)."""
    plain = torch.compile(traced, dynamic=False)
    # The two settings matter only where dynamo compiles: settled calls,
    # which cannot, skip setting them around each call.
    compiled = cache_key.keyed(_views_recomputed(plain), distribution)
    return Steady(
        compiled,
        code_of(traced),
        interleaved=interleaved,
        settled_call=plain,
        fixed=fixed,
    )


def _views_recomputed(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` partitioned with views recomputed in the backward.

    A region is a forward and a backward graph, so AOT autograd chooses what
    the forward saves. Saving a view (a Dense's input seen transposed for its
    weight's gradient) hides its base: the partitioner then saves relu's
    boolean mask beside it rather than recompute the mask from the base it
    keeps anyway, and inductor's CPU code stores and loads boolean masks 16
    lanes at a time through a slow path (torch 2.13: about 10 ns an element,
    twenty times relu itself). A whole step traces one graph and never meets
    this. Only the plugin's regions get the setting, not a user's compile.
    """
    try:
        patch = torch._functorch.config.patch(recompute_views=True)
    except (AttributeError, TypeError):  # another torch: as it partitions
        return compiled
    return patch(compiled)


def renamed(function: Callable[..., Any], qualname: str, name: str) -> Any:
    """``function`` with a code object of its own named ``qualname``: dynamo
    keeps its cache entries (and counts its recompile limit) per code object."""
    code = function.__code__.replace(co_qualname=qualname)
    named = types.FunctionType(
        code, function.__globals__, name, None, function.__closure__
    )
    named.__qualname__ = qualname
    return named


#: Megatron's "f" of a block's DTensor inputs inside its graph (False: made
#: eagerly before the region, as the mode did first; benchmarks compare).
IN_GRAPH_F = True
#: Block classes whose graph with the "f" inside failed to compile.
_EAGER_F: set[type] = set()


def _with_f(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` with Megatron's "f" of each DTensor input in its graph."""

    def call(block: Any, *args: Any, **kwargs: Any) -> Any:
        args, kwargs = pytree.tree_map(reducing_input, (args, kwargs))
        return original(block, *args, **kwargs)

    return renamed(call, original.__qualname__, original.__name__)


def settled() -> int:
    """How many blocks' calls skip dynamo's guards under this distribution."""
    by_class = _COMPILED.get(state.model_parallel(), {}) if _COMPILED else {}
    return sum(compiled.signatures_settled for compiled in by_class.values())


def forget() -> None:
    """Drop the compiled regions, failures and routes (on deactivation)."""
    _COMPILED.clear()
    _FAILED.clear()
    _EAGER_F.clear()
    _ROUTED.clear()


def name_scope(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict):
    """``Layer._open_name_scope``'s wrapper: no scope inside a region."""
    if REGION:
        return contextlib.nullcontext()
    return wrapped(*args, **kwargs)
