"""A keras-hub decoder block's cached call on local tensors (eager generation).

Through DTensor each op of a block is a dispatched op (about 130 a token for
a 4-layer Gemma), several times its math at generation's sizes. A block split
Megatron's way on one mesh axis runs as Megatron's decoder does: each rank
its own heads on local tensors, one all-reduce after each row-parallel
product, the KV cache split by heads. :func:`plan` refuses what it cannot
prove fits (another split, unknown attention, LoRA, quantized or
mixed-precision kernels, a laid-out output): that block stays on DTensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from keras_dtensor_fix.dtensor import DTensor, all_reduce_sum, wrap_local
from keras_dtensor_fix.dtensor.einsum import linear_equation
from keras_dtensor_fix.dtensor.megatron import local_part, with_split
from keras_dtensor_fix.dtensor.planner import shard_dim, split_axis
from keras_dtensor_fix.engine import state, targets
from keras_dtensor_fix.hub import generation as hub
from keras_dtensor_fix.ops.values import local_tensors, output_laid_out

#: :func:`attributes`' value for an attribute the instance does not hold.
UNSET = object()


@dataclass
class Plan:
    """How one block runs locally: what its call swaps, and back."""

    mesh: Any
    axis: int
    #: (variable, its local tensor)
    weights: list[tuple[Any, Any]] = field(default_factory=list)
    #: (attention layer, attribute, its count for one rank)
    heads: list[tuple[Any, str, int]] = field(default_factory=list)
    #: (row-parallel dense layer, its local call)
    rows: list[tuple[Any, Callable[..., Any]]] = field(default_factory=list)


def plan(block: Any) -> Plan | None:
    """The local plan of ``block``, or None where it must run on DTensors.

    Megatron's shape is required, not only inferred per weight: in each
    attention layer every split dense layer is column-parallel but its output
    projection, and outside them no more row-parallel layers than column ones.
    """
    dense = tuple(targets.keras_object(n) for n in ("Dense", "EinsumDense"))
    if any(output_laid_out(layer) for layer in block._flatten_layers()):
        return None  # Keras would lay out a local output as if it were whole
    split = [(v, v._value) for v in block.weights if isinstance(v._value, DTensor)]
    where = split_axis([value for _, value in split])
    if where is None:
        return None
    mesh, axis = where
    size = mesh.size(axis)
    sharded = {id(v): value for v, value in split if shard_dim(value, axis) is not None}
    result = Plan(mesh, axis, [(v, value.to_local()) for v, value in split])
    local = {id(v): t for v, t in result.weights}
    claimed: set[int] = set()
    kinds: dict[int, str] = {}  # id(dense layer) -> "column" / "row"
    attentions = []
    for layer in block._flatten_layers(include_self=False):
        counts = hub.head_counts(layer)
        if counts is not None:
            attentions.append(layer)
            for name in counts:
                count = getattr(layer, name, None)
                if not isinstance(count, int) or count % size:
                    return None
                result.heads.append((layer, name, count // size))
        elif hub.unknown_attention(layer):
            return None
        if isinstance(layer, dense):
            kind = _dense_kind(layer, dense[0], sharded, axis)
            if kind is None:
                return None
            if kind == "whole":
                continue
            kinds[id(layer)] = kind
            claimed.update((id(layer._kernel), id(layer.bias)))
            if kind == "row":
                result.rows.append((layer, _row_call(layer, local, mesh, axis)))
    if set(sharded) - claimed or not _megatron(kinds, attentions):
        return None  # a split weight outside a dense layer, or not Megatron's
    return result


def _dense_kind(layer: Any, plain: type, sharded: dict, axis: int) -> str | None:
    """``"column"``, ``"row"``, ``"whole"`` (nothing split), or None (refused)."""
    kernel, bias = getattr(layer, "_kernel", None), getattr(layer, "bias", None)
    if id(kernel) not in sharded:
        return None if id(bias) in sharded else "whole"
    if (
        getattr(layer, "lora_enabled", False)
        or getattr(layer, "quantization_mode", None) is not None
        or layer.compute_dtype != layer.variable_dtype
    ):
        return None
    value = sharded[id(kernel)]
    dim = shard_dim(value, axis)
    if value.shape[dim] % value.device_mesh.size(axis):
        return None
    if isinstance(layer, plain):
        kernel_in, out = "kn", "n"  # (in, out): the output keeps n
    else:
        operands, out = layer.equation.split("->")
        kernel_in = operands.split(",")[1]
    column = kernel_in[dim] in out
    if bias is not None and column != (id(bias) in sharded):
        return None  # a column's bias splits with it; a row's is whole
    return "column" if column else "row"


def _megatron(kinds: dict[int, str], attentions: list[Any]) -> bool:
    inside: set[int] = set()
    for attention in attentions:
        subs = {id(sub) for sub in attention._flatten_layers(include_self=False)}
        found = [kinds[key] for key in subs if key in kinds]
        if found and sorted(found) != ["column"] * (len(found) - 1) + ["row"]:
            return False
        inside |= subs
    outside = [kind for key, kind in kinds.items() if key not in inside]
    return outside.count("row") <= outside.count("column")


def _row_call(layer: Any, local: dict, mesh: Any, axis: int) -> Callable[..., Any]:
    """A row-parallel layer's call: local product, all-reduce, then bias."""
    equation = getattr(layer, "equation", None)  # EinsumDense's; Dense's by ndim
    kernel = local[id(layer._kernel)]
    bias = None if layer.bias is None else local.get(id(layer.bias), layer.bias.value)
    activation = layer.activation

    def call(inputs: Any, training: Any = None) -> Any:
        wanted = equation or linear_equation(inputs.ndim)
        x = all_reduce_sum(torch.einsum(wanted, inputs, kernel), mesh, (axis,))
        if bias is not None:
            x = x + bias
        return x if activation is None else activation(x)

    return call


@contextlib.contextmanager
def attributes(sets: list[tuple[Any, str, Any]]) -> Iterator[None]:
    """Each ``(obj, name, value)`` set on the instance (:data:`UNSET`: none)
    for the length of the context, then each instance's own put back."""
    saved = [(obj, name, vars(obj).get(name, UNSET)) for obj, name, _ in sets]
    try:
        for obj, name, value in sets:
            _put(obj, name, value)
        yield
    finally:
        for obj, name, value in reversed(saved):
            _put(obj, name, value)


def _put(obj: Any, name: str, value: Any) -> None:
    if value is UNSET:
        vars(obj).pop(name, None)
    else:
        object.__setattr__(obj, name, value)


@contextlib.contextmanager
def swapped(found: Plan) -> Iterator[None]:
    """The block's weights local, its heads one rank's, its row-parallel
    layers' local calls (their input holds this rank's share of features)."""
    sets = list(found.heads)
    for layer, call in found.rows:
        sets += [(layer, "call", call), (layer, "_input_spec", None)]
    # Every operand inside is plain: the gated wrappers (which fix DTensor
    # mixes) have nothing to do, and closed they cost no Python frame.
    sharding = list(state.SHARDING)
    state.SHARDING.clear()
    state.LOCAL_CALL.append(True)
    try:
        with attributes(sets), local_tensors([v for v, _ in found.weights]):
            yield
    finally:
        state.LOCAL_CALL.pop()
        state.SHARDING.extend(sharding)


def run(found: Plan, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``call(*args, **kwargs)`` (the block's own) on local tensors, or
    None where its inputs have no local form."""
    mesh, axis = found.mesh, found.axis
    x = args[0] if args else kwargs.get("x")
    like = x if isinstance(x, DTensor) else None
    key = next((k for k in hub.CACHE_ARGUMENTS if kwargs.get(k) is not None), None)
    cache = kwargs.get(key)
    if not hasattr(cache, "ndim") or kwargs.get("cross_attention_cache") is not None:
        return None  # no cache, or a third result
    heads = cache.ndim + hub.CACHE_HEADS
    local_args = [local_part(a, mesh, axis, None, like) for a in args]
    local_kwargs = {
        k: local_part(v, mesh, axis, heads if k == key else None, like)
        for k, v in kwargs.items()
    }
    given, local = [*args, *kwargs.values()], [*local_args, *local_kwargs.values()]
    if any(b is None and a is not None for a, b in zip(given, local, strict=True)):
        return None
    with swapped(found):
        result = call(*local_args, **local_kwargs)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise TypeError(
            f"keras-dtensor-fix: a decoder block called with a cache returned "
            f"{type(result).__name__}, not (outputs, cache): set "
            f"KERAS_DTENSOR_FIX_DISABLE=generate and report it"
        )
    out, new_cache = result
    if like is not None:
        out = wrap_local(out, mesh, with_split(like, mesh, axis, None))
    cached = cache if isinstance(cache, DTensor) else like
    return out, wrap_local(new_cache, mesh, with_split(cached, mesh, axis, heads))
