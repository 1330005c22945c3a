"""A keras-hub causal LM's one-token call on local tensors (sharded generation).

Beyond the blocks a token still ran about 30 dispatched DTensor ops. Where
every block has a :func:`.decoder.plan` on one mesh axis, every other axis
has one rank, the tied token embedding is replicated or split by vocabulary
and every other weight is replicated, the whole call runs on local tensors;
the KV cache stays this rank's heads from one token to the next, so only
samplers that pass it on untouched qualify (``hub.generation.SAMPLERS``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from keras_dtensor_fix.dtensor import DTensor, all_gather_last, all_reduce_sum, megatron
from keras_dtensor_fix.dtensor.placement import same_mesh
from keras_dtensor_fix.dtensor.planner import shard_dim, whole
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.generation import decoder, token_args
from keras_dtensor_fix.hub import generation as hub
from keras_dtensor_fix.ops.values import local_tensors, walk


@dataclass
class ModelPlan:
    """How one model's token call runs locally."""

    mesh: Any
    axis: int
    blocks: list[tuple[Any, decoder.Plan]]
    #: every other DTensor variable
    weights: list[Any]
    #: (the token embedding, its local call) where its table is split
    embedding: tuple[Any, Callable[..., Any]] | None = None
    #: the cache this plan's last call returned (this rank's heads)
    last_cache: Callable[[], Any] = field(default=lambda: None)


def plan(model: Any, blocks: list[tuple[Any, decoder.Plan]]) -> ModelPlan | None:
    """The local plan of ``model``'s one-token call given its decoder
    blocks' (``compiled.blocks.repeated``'s, each with its plan), or None
    (see the module)."""
    if not hub.known_sampler(model):
        return None
    if token_args.signature_of(getattr(model, "call_with_cache", None)) is None:
        return None  # a call whose token, cache and index :func:`run` cannot tell
    embedding = hub.token_embedding(model)
    if not blocks or embedding is None:
        return None
    plans = [found for _, found in blocks]
    mesh, axis = plans[0].mesh, plans[0].axis
    if any(not same_mesh(p.mesh, mesh) or p.axis != axis for p in plans):
        return None
    if any(mesh.size(i) != 1 for i in range(mesh.ndim) if i != axis):
        return None
    owned = {id(v) for found in plans for v, _ in found.weights}
    table = getattr(embedding, "_embeddings", None)
    result = ModelPlan(mesh, axis, list(blocks), [])
    for variable in model.weights:
        value = getattr(variable, "_value", None)
        if id(variable) in owned or not isinstance(value, DTensor):
            continue
        if not same_mesh(value.device_mesh, mesh):
            return None
        if variable is table and shard_dim(value, axis) is not None:
            call = _embedding_call(embedding, value, mesh, axis)
            if call is None:
                return None
            result.embedding = (embedding, call)
        elif not whole(value):
            return None  # a weight split outside the blocks and the table
        result.weights.append(variable)
    return result


def _embedding_call(
    layer: Any, table: DTensor, mesh: Any, axis: int
) -> Callable[..., Any] | None:
    """The token embedding's call on its vocabulary rows, or None."""
    try:
        reversible = targets.keras_object("ReversibleEmbedding")
    except (ImportError, AttributeError):  # an older Keras
        return None
    if (
        not isinstance(layer, reversible)
        or not getattr(layer, "tie_weights", False)
        or getattr(layer, "mask_zero", False)
        or getattr(layer, "reverse_dtype", None) is not None
        or getattr(layer, "quantization_mode", None) is not None
        or layer.compute_dtype != layer.variable_dtype
        or shard_dim(table, axis) != 0
        or table.shape[0] % mesh.size(axis)
    ):
        return None
    local = table.to_local()
    rows = local.shape[0]
    start = mesh.get_local_rank(axis) * rows
    soft_cap = getattr(layer, "logit_soft_cap", None)

    def call(inputs: Any, reverse: bool = False) -> torch.Tensor:
        if not reverse:  # vocabulary-parallel lookup
            ids = inputs.to(torch.int64) - start
            inside = (ids >= 0) & (ids < rows)
            found = torch.nn.functional.embedding(torch.where(inside, ids, 0), local)
            found = found * inside.unsqueeze(-1).to(found.dtype)
            return all_reduce_sum(found, mesh, (axis,))
        logits = all_gather_last(torch.matmul(inputs, local.T), mesh, axis)
        if soft_cap is not None:
            logits = torch.tanh(logits / soft_cap) * soft_cap
        return logits

    return call


@contextlib.contextmanager
def _swapped(found: ModelPlan) -> Iterator[None]:
    """Every weight local, the embedding's call local, the blocks' own calls."""
    sets = [(block, "call", decoder.UNSET) for block, _ in found.blocks]
    if found.embedding is not None:
        sets.append((found.embedding[0], "call", found.embedding[1]))
    with contextlib.ExitStack() as stack:
        stack.enter_context(decoder.attributes(sets))
        for _, block_plan in found.blocks:
            stack.enter_context(decoder.swapped(block_plan))
        stack.enter_context(local_tensors(found.weights))
        yield


def run(
    found: ModelPlan,
    call: Callable[..., Any],
    token_ids: Any,
    cache: Any,
    index: Any,
    **extra: Any,
) -> Any:
    """``call(token_ids, cache, index, **extra)`` (the model's own) on local
    tensors: logits and hidden states whole, the cache this rank's heads;
    None where an input has no local form."""
    mesh, axis = found.mesh, found.axis
    if not (isinstance(cache, DTensor) or cache is found.last_cache()):
        return None  # a plain cache that this plan did not make
    ours = not isinstance(cache, DTensor)
    if not ours:
        cache = megatron.local_part(cache, mesh, axis, cache.ndim + hub.CACHE_HEADS)
    token_ids = megatron.local_part(token_ids, mesh, axis, None)
    index = megatron.local_part(index, mesh, axis, None)
    local = {k: megatron.local_part(v, mesh, axis, None) for k, v in extra.items()}
    if any(local[k] is None and v is not None for k, v in extra.items()):
        token_ids = None  # a whole value of each rank's has no local form
    if cache is None or token_ids is None or index is None:
        if ours:  # the cache is this rank's heads: no other path can take it
            raise RuntimeError(
                "keras-dtensor-fix: a token of generate() has no local form on "
                "this model; set KERAS_DTENSOR_FIX_DISABLE=generate and report it"
            )
        return None
    with _swapped(found):
        logits, hidden, new_cache = call(token_ids, cache, index, **local)
    found.last_cache = weakref.ref(new_cache)
    return logits, hidden, new_cache


def as_dtensors(found: ModelPlan, result: Any) -> tuple[Any, ...]:
    """:func:`run`'s result with the cache as the DTensor it is a part of."""
    logits, hidden, cache = result
    heads = cache.ndim + hub.CACHE_HEADS
    placements = megatron.with_split(None, found.mesh, found.axis, heads)
    return logits, hidden, DTensor.from_local(cache, found.mesh, placements)


def whole_inputs(args: tuple) -> tuple:
    """``generate_step``'s arguments, each DTensor every process holds whole
    as its local tensor: the sampler's loop then runs plain torch ops."""

    def leaf(value: Any, _layout: Any) -> Any:
        if isinstance(value, DTensor) and whole(value):
            return value.to_local()
        return value

    return walk(args, None, leaf)
