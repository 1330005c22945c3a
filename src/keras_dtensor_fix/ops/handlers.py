"""The op-handler table: what a wrapped Keras backend op does with DTensors.

The ``numpy`` and ``ops`` families wrap the backend's multi-tensor functions with
:func:`wrapper_for`. Without a DTensor among the arguments the original runs at once
(the fast path). Otherwise the rows of :data:`HANDLERS` that apply to the op run in this
order on one :class:`Call` until one returns something other than :data:`NOT_HANDLED`:

  1. ``convolution``: per rank on its batch rows, kernels gathered.
  2. ``attention``: per rank on the query's batch and head shards.
  3. ``slice_update``: the write on local tensors in the updates' placements.
  4. ``lookup`` (``take``): the table gathered on the axes splitting the ids
     (compiled, a row-split table vocab-parallel); hands on.
  5. ``index`` (``argmax``), 6. ``classes`` (:data:`CLASS_AXIS_LOSSES`) and
     7. ``normalized`` (``rms_normalization``): the operand gathered on the
     reduced axis, once per activation; hand on.
  8. ``local`` (``einsum``, ``matmul``): one local einsum where placements allow.
  9. ``per_element`` (``one_hot``): each rank's shard mapped alone.
  10. ``replicated``: every operand whole and no gradient: the op on local
      tensors, wrapped once; an error hands on to ``promote``.
  11. ``promote``: plain tensors beside a DTensor become Replicate (one of a
      shard's size refused), a Partial result reduced; no rule: full values.

Rows 1-3 (:mod:`.layout`) and 11 always return."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from keras_dtensor_fix.dtensor import (
    DTensor,
    gather_axes_splitting,
    gather_axis,
    per_element_call,
    reduce_masked,
    reduce_partial,
    replicate_result,
    replicated_locals,
    vocab_parallel_lookup,
)
from keras_dtensor_fix.dtensor.einsum import local_einsum, local_matmul
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.ops import layout
from keras_dtensor_fix.ops.call import NOT_HANDLED, Call, Op, Unbound
from keras_dtensor_fix.ops.values import promote_call, resolve

__all__ = [
    "HANDLERS",
    "NOT_HANDLED",
    "Call",
    "Handler",
    "Op",
    "target_names",
    "wrapper_for",
]

SEQUENCE_PARAMS = frozenset({"xs", "arrays", "tensors", "condlist", "choicelist"})
# Binary ops whose operands broadcast elementwise: a plain operand of one
# rank's shard size is refused there. Other ops promote without that check.
NOT_ELEMENTWISE = frozenset(
    "matmul dot inner outer kron tensordot vdot cross correlate append isin einsum "
    "digitize searchsorted".split()
)


# Public helpers of the numpy module, not ops: only its (wrapped) ops call them,
# after promoting, so a wrapper there would check every binary op twice.
HELPERS = frozenset({"convert_to_tensors_of_same_dtype"})
# Contractions: over a sharded axis they return Partial sums, reduced at once.
CONTRACTIONS = frozenset({"matmul", "dot", "inner", "tensordot", "vdot", "einsum"})
# Losses reading the whole class axis (``axis``, default -1) of ``output``:
# the softmax over a sharded axis needs all of it.
CLASS_AXIS_LOSSES = frozenset(
    ("sparse_categorical_crossentropy", "categorical_crossentropy")
)


def takes_several_tensors(fn: Any) -> bool:
    """Whether ``fn``'s signature lets it take two or more tensors."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    names = [
        p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(names) >= 2 or (len(names) == 1 and names[0] in SEQUENCE_PARAMS)


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


def is_elementwise(name: str, signature: inspect.Signature) -> bool:
    if name in NOT_ELEMENTWISE:
        return False
    params = list(signature.parameters)[:2]
    return params in (["x1", "x2"], ["x", "y"]) or name in ("where", "clip")


@dataclass(frozen=True)
class Handler:
    """One row of :data:`HANDLERS`."""

    name: str
    applies: Callable[[Op], bool]  # asked once per op, when its wrapper is made
    handle: Callable[[Call], Any]  # a result, or NOT_HANDLED


def _lookup(call: Call) -> Any:
    arguments = call.arguments
    if "x" not in arguments or "indices" not in arguments:
        return NOT_HANDLED
    indices = resolve(arguments["indices"])
    table = arguments["x"] = gather_axes_splitting(resolve(arguments["x"]), indices)
    if torch.compiler.is_compiling() and arguments.get("axis") == 0:
        # DTensor's own row-split lookup keeps state a trace cannot.
        found = vocab_parallel_lookup(table, indices)
        if found is not None:
            return found
    return NOT_HANDLED


def _gathering(
    operand: str, default: int | None, needs: str | None = None
) -> Callable[[Call], Any]:
    """A row gathering ``operand`` on the call's ``axis`` (``default`` if not given; a
    list: each) for the rows after it; not a call without ``needs`` or whose axis is
    neither an int nor ``default``."""

    def handle(call: Call) -> Any:
        arguments = call.arguments
        axis = arguments.get("axis", default)
        axes = axis if isinstance(axis, (list, tuple)) else [axis]
        if operand not in arguments or (needs and needs not in arguments):
            return NOT_HANDLED
        if all(isinstance(a, int) or a is default for a in axes):
            for one in axes:
                arguments[operand] = gather_axis(resolve(arguments[operand]), one)
        return NOT_HANDLED

    return handle


def _local(call: Call) -> Any:
    arguments = call.arguments
    local = None
    if call.op.name == "einsum":
        subscripts = arguments.get("subscripts")
        if isinstance(subscripts, str) and not arguments.get("kwargs"):
            operands = [resolve(v) for v in arguments.get("operands", ())]
            local = local_einsum(subscripts, operands)
    elif "x1" in arguments and "x2" in arguments:  # matmul
        local = local_matmul(resolve(arguments["x1"]), resolve(arguments["x2"]))
    return NOT_HANDLED if local is None else reduce_partial(local)


def _per_element(call: Call) -> Any:
    # each element of ``x`` mapped to new trailing dims (``axis``: where)
    arguments = call.arguments
    if "x" not in arguments:
        return NOT_HANDLED
    value = resolve(arguments["x"])
    if arguments.get("axis", -1) not in (-1, getattr(value, "ndim", None)):
        return NOT_HANDLED
    result = per_element_call(lambda local: call.run(x=local), value)
    return NOT_HANDLED if result is None else result


def _replicated(call: Call) -> Any:
    args, kwargs = call.args, call.kwargs
    found = replicated_locals([resolve(v) for v in (*args, *kwargs.values())])
    if found is None:
        return NOT_HANDLED
    mesh, local = found
    n = len(args)
    try:
        result = call.wrapped(*local[:n], **dict(zip(kwargs, local[n:], strict=True)))
    except Exception:  # noqa: BLE001 - the next handler names the operands
        return NOT_HANDLED
    return replicate_result(result, mesh)


def _promote(call: Call) -> Any:
    op = call.op
    result = promote_call(
        call.wrapped, call.args, call.kwargs, op=op.name, elementwise=op.elementwise
    )
    return reduce_partial(result) if op.contraction else reduce_masked(result)


#: The one registry of op handlers, in the order they run (the module's
#: docstring says what each does).
HANDLERS: tuple[Handler, ...] = (
    Handler("convolution", lambda op: op.name in layout.CONVOLUTIONS, layout.conv),
    Handler(
        "attention", lambda op: op.name == "dot_product_attention", layout.attention
    ),
    Handler("slice_update", lambda op: op.name == "slice_update", layout.update),
    Handler("lookup", lambda op: op.name == "take", _lookup),
    # An index reduction over a sharded axis needs the whole axis.
    Handler("index", lambda op: op.name in ("argmax", "argmin"), _gathering("x", None)),
    Handler(
        "classes",
        lambda op: op.name in CLASS_AXIS_LOSSES,
        _gathering("output", -1, needs="target"),
    ),
    # torch's rms_norm over a sharded dim: its decomposition adds epsilon in place to
    # a Partial mean, which DTensor refuses (torch 2.13), eagerly and traced; a hidden
    # dim split on a one-rank batch axis (an embedding's (model, batch) layout on
    # (1, N)) is relabelled, no data moves. The layer's axis is a list.
    Handler(
        "normalized", lambda op: op.name == "rms_normalization", _gathering("x", -1)
    ),
    Handler("local", lambda op: op.name in ("einsum", "matmul"), _local),
    Handler("per_element", lambda op: op.name == "one_hot", _per_element),
    Handler("replicated", lambda op: True, _replicated),
    Handler("promote", lambda op: True, _promote),
)


def handle(chain: tuple[Handler, ...], call: Call) -> Any:
    """Run ``chain`` on one call: the first result wins, else the original."""
    try:
        for handler in chain:
            result = handler.handle(call)
            if result is not NOT_HANDLED:
                return result
    except Unbound:
        pass  # a call that does not fit the signature: the op raises its own error
    return call.run()


def wrapper_for(name: str, function: Any, *, elementwise: bool | None = None):
    """The wrapt wrapper for backend op ``name`` (``function``, the original):
    the fast path, else :func:`handle`."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        signature = None
    if elementwise is None:
        elementwise = signature is not None and is_elementwise(name, signature)
    op = Op(name, elementwise, name in CONTRACTIONS, signature)
    keras_variable = targets.keras_object("Variable")
    chain = tuple(handler for handler in HANDLERS if handler.applies(op))

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
        for value in (*args, *kwargs.values()) if kwargs else args:
            if type(value) not in plain and distributed(value):
                return handle(chain, Call(op, wrapped, args, kwargs))
        return wrapped(*args, **kwargs)

    return wrapper
