"""The op-handler table: what a wrapped Keras backend op does with DTensors.

The ``numpy`` and ``ops`` families wrap the torch backend's multi-tensor
functions with :func:`wrapper_for`. A wrapper whose arguments hold no DTensor
calls the original at once (the fast path: a set lookup per argument).
Otherwise:

* a *special* op (:data:`SPECIAL`: convolutions, attention, ``slice_update``)
  runs its own handler, which knows the op's signature;
* any other op runs the handlers of :data:`HANDLERS` that apply to it, in
  this order, until one returns a result:

  1. ``lookup`` (``take``): the table gathered on the mesh axes that split the
     ids (:func:`~keras_dtensor_fix.dtensor.gather_axes_splitting`); under
     torch.compile a row-split table is looked up vocab-parallel. It rewrites
     the arguments and hands on.
  2. ``index`` (``argmax``, ``argmin``) and ``classes`` (the cross-entropies
     of :data:`CLASS_AXIS_LOSSES`): the operand gathered on the reduced dim or
     the class axis (:func:`~keras_dtensor_fix.dtensor.gather_axis`, once per
     activation: a loss and an accuracy metric on the same vocabulary-sharded
     logits share one all-gather); hands on.
  3. ``local`` (``einsum``, ``matmul``): operands whose placements have a local
     form run as one local einsum; a Partial result is reduced where it is made.
  4. ``per_element`` (``one_hot``): each rank's shard mapped alone, the
     placements kept (:func:`~keras_dtensor_fix.dtensor.per_element_call`);
     DTensor has no rule for ``one_hot`` under torch.compile.
  5. ``replicated``: every DTensor operand replicated and no gradient (a step
     counter, a metric): the op on local tensors, the result wrapped once.
  6. ``promote``: plain tensors next to a DTensor become Replicate DTensors (a
     plain operand of one rank's shard size is refused in elementwise ops),
     then the op; a contraction's Partial result, or a masked lookup's, is
     reduced. If DTensor has no rule for the op, it runs on full values.
     Always returns.

Adding a handler is a function here and a row in :data:`HANDLERS` (or an entry
in :data:`SPECIAL` for an op that needs its own signature).
"""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keras_dtensor_fix.values import (
    promote_call,
    resolve,
    variable_class,
)

SEQUENCE_PARAMS = frozenset({"xs", "arrays", "tensors", "condlist", "choicelist"})
# Binary ops whose operands broadcast elementwise: a plain operand of one
# rank's shard size is refused there. Other ops promote without that check.
NOT_ELEMENTWISE = frozenset(
    {
        "matmul",
        "dot",
        "inner",
        "outer",
        "kron",
        "tensordot",
        "vdot",
        "cross",
        "correlate",
        "append",
        "isin",
        "einsum",
        "digitize",
        "searchsorted",
    }
)


# Public helpers of the numpy module, not ops: only its (wrapped) ops call them,
# after promoting, so a wrapper there would check every binary op twice.
HELPERS = frozenset({"convert_to_tensors_of_same_dtype"})

# Contractions: over a sharded axis they return Partial sums, reduced at once.
CONTRACTIONS = frozenset({"matmul", "dot", "inner", "tensordot", "vdot", "einsum"})


# Index reductions: over a sharded axis they need the whole axis.
INDEX_REDUCTIONS = frozenset({"argmax", "argmin"})


# Losses reading the whole class axis (``axis``, default -1) of ``output``
# (their second argument): the softmax over a sharded axis needs all of it.
CLASS_AXIS_LOSSES = frozenset(
    {"sparse_categorical_crossentropy", "categorical_crossentropy"}
)


# Ops mapping each element of their first argument to new trailing dims
# (``axis``, default -1, says where the new dim goes).
PER_ELEMENT = frozenset({"one_hot"})


# Convolutions and the names of their kernels.
CONVOLUTIONS = {
    "conv": ("kernel",),
    "depthwise_conv": ("kernel",),
    "conv_transpose": ("kernel",),
    "separable_conv": ("depthwise_kernel", "pointwise_kernel"),
}


def takes_several_tensors(fn: Any) -> bool:
    """Whether ``fn``'s signature lets it take two or more tensors."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    if positional and positional[0].name in SEQUENCE_PARAMS:
        return True
    return len(positional) >= 2


def target_names(module: types.ModuleType) -> list[str]:
    """Public functions defined in ``module`` that take two or more tensors."""
    return sorted(
        name
        for name, fn in vars(module).items()
        if not name.startswith("_")
        and name not in HELPERS
        and inspect.isfunction(fn)
        and fn.__module__ == module.__name__
        and takes_several_tensors(fn)
    )


def is_elementwise(name: str, fn: Any) -> bool:
    if name in NOT_ELEMENTWISE:
        return False
    params = list(inspect.signature(fn).parameters)[:2]
    return params in (["x1", "x2"], ["x", "y"]) or name in ("where", "clip")


@dataclass(frozen=True)
class Op:
    """What the handlers know about the op they handle."""

    name: str
    elementwise: bool  # operands broadcast elementwise (per-rank shards refused)
    contraction: bool  # a product over an axis: a Partial result is reduced


#: A handler's "not mine": the next handler runs.
NOT_HANDLED = object()


@dataclass(frozen=True)
class Rewritten:
    """A handler's new arguments for the handlers after it."""

    args: tuple
    kwargs: dict


Handle = Callable[[Op, Callable[..., Any], tuple, dict], Any]


@dataclass(frozen=True)
class Handler:
    """One row of :data:`HANDLERS`."""

    name: str
    applies: Callable[[Op], bool]
    handle: Handle


def _axis(args: tuple, kwargs: dict) -> Any:
    """The ``axis`` argument of ``take(x, indices, axis=None)``."""
    return args[2] if len(args) > 2 else kwargs.get("axis")


def _lookup(op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    import torch

    from keras_dtensor_fix.dtensor import gather_axes_splitting, vocab_parallel_lookup

    if len(args) < 2:
        return NOT_HANDLED
    table = gather_axes_splitting(resolve(args[0]), resolve(args[1]))
    args = (table, *args[1:])
    if torch.compiler.is_compiling() and _axis(args, kwargs) == 0:
        # DTensor's own row-split lookup keeps state a trace cannot.
        found = vocab_parallel_lookup(table, resolve(args[1]))
        if found is not None:
            return found
    return Rewritten(args, kwargs)


def _index(op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from keras_dtensor_fix.dtensor import gather_axis

    if not args:
        return NOT_HANDLED
    axis = args[1] if len(args) > 1 else kwargs.get("axis")
    if axis is not None and not isinstance(axis, int):
        return NOT_HANDLED
    return Rewritten((gather_axis(resolve(args[0]), axis), *args[1:]), kwargs)


def _classes(op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from keras_dtensor_fix.dtensor import gather_axis

    if len(args) < 2:
        return NOT_HANDLED
    axis = args[3] if len(args) > 3 else kwargs.get("axis", -1)
    if not isinstance(axis, int):
        return NOT_HANDLED
    return Rewritten((args[0], gather_axis(resolve(args[1]), axis), *args[2:]), kwargs)


def _local(op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from keras_dtensor_fix.dtensor import reduce_partial
    from keras_dtensor_fix.einsum import local_einsum, local_matmul

    if kwargs:
        return NOT_HANDLED
    local = None
    if op.name == "einsum" and args and isinstance(args[0], str):
        local = local_einsum(args[0], [resolve(v) for v in args[1:]])
    elif op.name == "matmul" and len(args) == 2:
        local = local_matmul(resolve(args[0]), resolve(args[1]))
    return NOT_HANDLED if local is None else reduce_partial(local)


def _per_element(op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from keras_dtensor_fix.dtensor import per_element_call

    if not args:
        return NOT_HANDLED
    value = resolve(args[0])
    axis = args[2] if len(args) > 2 else kwargs.get("axis", -1)
    if axis not in (-1, getattr(value, "ndim", None)):
        return NOT_HANDLED
    result = per_element_call(lambda local: wrapped(local, *args[1:], **kwargs), value)
    return NOT_HANDLED if result is None else result


def _replicated(op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from keras_dtensor_fix.dtensor import replicate_result, replicated_locals

    resolved = [resolve(v) for v in args]
    names = list(kwargs)
    found = replicated_locals(resolved + [resolve(kwargs[k]) for k in names])
    if found is None:
        return NOT_HANDLED
    mesh, local = found
    n = len(resolved)
    result = wrapped(*local[:n], **dict(zip(names, local[n:], strict=True)))
    return replicate_result(result, mesh)


def _promote(op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    from keras_dtensor_fix.dtensor import reduce_masked, reduce_partial

    result = promote_call(wrapped, args, kwargs, op=op.name, elementwise=op.elementwise)
    return reduce_partial(result) if op.contraction else reduce_masked(result)


#: The handlers of a non-special op, in the order they run (see the module's
#: docstring). ``applies`` is asked once per op, when its wrapper is made.
HANDLERS: tuple[Handler, ...] = (
    Handler("lookup", lambda op: op.name == "take", _lookup),
    Handler("index", lambda op: op.name in INDEX_REDUCTIONS, _index),
    Handler("classes", lambda op: op.name in CLASS_AXIS_LOSSES, _classes),
    Handler("local", lambda op: op.name in ("einsum", "matmul"), _local),
    Handler("per_element", lambda op: op.name in PER_ELEMENT, _per_element),
    Handler("replicated", lambda op: True, _replicated),
    Handler("promote", lambda op: True, _promote),
)


def chain_for(op: Op) -> tuple[Handler, ...]:
    """The handlers that apply to ``op``, in table order."""
    return tuple(handler for handler in HANDLERS if handler.applies(op))


def handle(
    chain: tuple[Handler, ...],
    op: Op,
    wrapped: Callable[..., Any],
    args: tuple,
    kwargs: dict,
) -> Any:
    """Run ``chain`` on one call: the first result wins."""
    for handler in chain:
        result = handler.handle(op, wrapped, args, kwargs)
        if result is NOT_HANDLED:
            continue
        if type(result) is Rewritten:
            args, kwargs = result.args, result.kwargs
            continue
        return result
    return wrapped(*args, **kwargs)


def make_wrapper(name: str, elementwise: bool):
    """The wrapt wrapper of one non-special op: fast path, else :func:`handle`."""
    import torch

    from keras_dtensor_fix.dtensor import DTensor

    keras_variable = variable_class()
    op = Op(name, elementwise, name in CONTRACTIONS)
    chain = chain_for(op)

    def distributed(value: Any) -> bool:
        if isinstance(value, DTensor):
            return True
        if isinstance(value, keras_variable):
            return isinstance(value._value, DTensor)
        if isinstance(value, (list, tuple)):
            return any(distributed(v) for v in value)
        return False

    # Types that can never hold a DTensor: one set lookup per argument.
    plain = {torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)}

    def wrapper(wrapped, instance, args, kwargs):
        for value in args:
            if type(value) not in plain and distributed(value):
                return handle(chain, op, wrapped, args, kwargs)
        if kwargs:
            for value in kwargs.values():
                if type(value) not in plain and distributed(value):
                    return handle(chain, op, wrapped, args, kwargs)
        return wrapped(*args, **kwargs)

    return wrapper


def make_conv_wrapper(name: str, signature: inspect.Signature):
    """A convolution on DTensors runs per rank on its batch rows, kernels gathered.

    torch's DTensor convolution handles replicated and width-sharded inputs
    only: a kernel sharded on any axis, or activations sharded on channels by
    the sharded bias of the conv before, come out with the wrong shape or
    values. Gathering the kernels (small next to activations) works for every
    layout and every Keras conv layer.
    """
    from keras_dtensor_fix.dtensor import DTensor, batch_parallel_call

    names = ("inputs", *CONVOLUTIONS[name])

    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        operands = [resolve(bound.arguments[k]) for k in names]
        found = [v for v in operands if isinstance(v, DTensor)]
        if not found:
            return wrapped(*args, **kwargs)
        mesh = found[0].device_mesh
        if any(v.device_mesh != mesh for v in found):
            return wrapped(*args, **kwargs)  # DTensor's own error names them

        def local(value, *kernels):
            for key, kernel in zip(names[1:], kernels, strict=True):
                bound.arguments[key] = kernel
            bound.arguments["inputs"] = value
            return wrapped(*bound.args, **bound.kwargs)

        return batch_parallel_call(local, operands[0], operands[1:], mesh)

    return wrapper


def make_update_wrapper(signature: inspect.Signature):
    """``slice_update(inputs, start_indices, updates)`` across DTensor layouts.

    keras-hub's ``generate()`` writes DTensor keys and values into a cache
    made with ``ops.zeros`` (plain), where DTensor refuses the in-place copy
    ("in-place operations that require placement changes are not
    supported"). The write runs on local tensors in the updates' placements
    (:func:`~keras_dtensor_fix.dtensor.update_in_place_of`), so a head-sharded
    cache stays sharded from the first step on.
    """
    from keras_dtensor_fix.dtensor import update_in_place_of, wrap_local
    from keras_dtensor_fix.values import full_value

    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        found = update_in_place_of(
            resolve(bound.arguments["inputs"]), resolve(bound.arguments["updates"])
        )
        if found is None:
            return wrapped(*args, **kwargs)
        mesh, inputs, updates, placements = found
        bound.arguments["inputs"], bound.arguments["updates"] = inputs, updates
        bound.arguments["start_indices"] = full_value(bound.arguments["start_indices"])
        return wrap_local(wrapped(*bound.args, **bound.kwargs), mesh, placements)

    return wrapper


def make_attention_wrapper(signature: inspect.Signature):
    """``dot_product_attention`` per rank on batch- and head-sharded shards.

    Keras's torch implementation moves DTensor operands to their local shards
    with ``hasattr(key, "to_local")``, which dynamo answers False for, so the
    compiled step mixes a local query with DTensor keys; and it takes a mask's
    whole local tensor, whatever its placements, next to a batch-sharded
    query. Here query, key and value keep the query's batch (dim 0) and head
    (dim 2) shards and are gathered on anything else (attention needs every
    key position); a mask or bias, aligned with torch's (batch, heads, query,
    key) from the right, takes the matching shards. The result comes back as
    a DTensor with the query's placements.
    """
    from torch.distributed.tensor import Replicate, Shard

    from keras_dtensor_fix.dtensor import DTensor, replicate

    def kept(placement: Any) -> Any:
        return placement if placement in (Shard(0), Shard(2)) else Replicate()

    def mask_placement(placement: Any, mask: Any, query: Any) -> Any:
        # Keras's query is (batch, seq, heads, dim); the mask broadcasts
        # against (batch, heads, seq, seq).
        dim = {0: mask.ndim - 4, 2: mask.ndim - 3}.get(getattr(placement, "dim", -1))
        if dim is None or dim < 0 or mask.shape[dim] == 1:
            return Replicate()
        return Shard(dim)

    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        query = resolve(bound.arguments["query"])
        if not isinstance(query, DTensor):
            return wrapped(*args, **kwargs)
        mesh = query.device_mesh
        placements = tuple(kept(p) for p in query.placements)
        for name in ("query", "key", "value", "bias", "mask"):
            tensor = resolve(bound.arguments.get(name))
            if tensor is None:
                continue
            if not isinstance(tensor, DTensor):
                tensor = replicate(tensor, mesh)  # a plain operand: the full value
            target = placements
            if name in ("bias", "mask"):
                target = tuple(mask_placement(p, tensor, query) for p in placements)
            if tuple(tensor.placements) != target:
                tensor = tensor.redistribute(mesh, target)
            bound.arguments[name] = tensor.to_local()
        output = wrapped(*bound.args, **bound.kwargs)
        return DTensor.from_local(output, mesh, placements, run_check=False)

    return wrapper


#: Ops with a handler of their own (it binds the op's signature): name ->
#: ``factory(name, signature)`` returning the wrapt wrapper.
SPECIAL: dict[str, Callable[[str, inspect.Signature], Any]] = {
    **{name: make_conv_wrapper for name in CONVOLUTIONS},
    "dot_product_attention": lambda name, signature: make_attention_wrapper(signature),
    "slice_update": lambda name, signature: make_update_wrapper(signature),
}


def wrapper_for(name: str, function: Any, *, elementwise: bool | None = None):
    """The wrapt wrapper for backend op ``name`` (``function``, the original).

    ``elementwise`` defaults to what the op's name and signature say.
    """
    factory = SPECIAL.get(name)
    if factory is not None:
        return factory(name, inspect.signature(function))
    if elementwise is None:
        elementwise = is_elementwise(name, function)
    return make_wrapper(name, elementwise)
