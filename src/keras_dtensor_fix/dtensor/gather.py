"""Op-specific layouts: what an op needs gathered or split to run correctly."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_dtensor_fix.dtensor.local import replicate
from keras_dtensor_fix.dtensor.placement import (
    placed,
    redistributed,
    reduce_partial,
    same_mesh,
)


def vocab_parallel_lookup(table: Any, ids: Any) -> DTensor | None:
    """``embedding(ids, table)`` for a table split on its rows, with no mask state.

    DTensor's ``_MaskPartial`` keeps its mask in a Python buffer that a trace cannot
    hold (dynamo runs the forward twice; the first run releases it). Here each rank
    looks up its own rows and zeroes the rest, then the partial sums are reduced:
    Megatron's vocabulary-parallel embedding. Negative ids count from the end. None
    unless ``table`` is 2-D split on its rows by one mesh axis."""
    if not isinstance(table, DTensor) or table.ndim != 2:
        return None
    mesh = table.device_mesh
    rows = [i for i, p in enumerate(table.placements) if p == Shard(0)]
    if len(rows) != 1 or any(p.is_partial() for p in table.placements):
        return None
    axis = rows[0]
    if isinstance(ids, DTensor):
        pending = any(p.is_partial() for p in ids.placements)
        if pending or not same_mesh(ids.device_mesh, mesh):
            return None
        id_placements = tuple(
            Replicate() if i == axis else p for i, p in enumerate(ids.placements)
        )
        local_ids = redistributed(ids, id_placements).to_local()
    else:
        id_placements = (Replicate(),) * mesh.ndim
        local_ids = ids
    out_placements, table_grads = [], []
    for i, (mine, theirs) in enumerate(
        zip(table.placements, id_placements, strict=True)
    ):
        if i == axis:
            out_placements.append(Partial())
            table_grads.append(mine)
        elif isinstance(mine, Shard) and isinstance(theirs, Shard):
            return None  # gather_axes_splitting gathers such a table first
        elif isinstance(mine, Shard):  # the embedding dim
            out_placements.append(Shard(local_ids.ndim))
            table_grads.append(mine)
        else:  # a replicated table, ids split or not
            out_placements.append(theirs)
            # Each rank's rows of ids give part of the table's gradient.
            table_grads.append(Partial() if isinstance(theirs, Shard) else mine)
    vocab = table.shape[0]
    size, offset = Shard.local_shard_size_and_offset(
        vocab, mesh.size(axis), mesh.get_coordinate()[axis]
    )
    local_ids = local_ids.long()
    local_ids = torch.where(local_ids < 0, local_ids + vocab, local_ids)
    outside = (local_ids < offset) | (local_ids >= offset + size)
    shifted = torch.where(outside, 0, local_ids - offset)
    local_table = table.to_local(grad_placements=tuple(table_grads))
    found = torch.nn.functional.embedding(shifted, local_table)
    found = found.masked_fill(outside.unsqueeze(-1), 0)
    partial = DTensor.from_local(found, mesh, tuple(out_placements), run_check=False)
    return reduce_partial(partial)


def gather_non_batch_axes(value: Any, batch_dim_name: str | None) -> Any:
    """This process's rows of ``value``: every mesh axis but the batch gathered."""
    if not isinstance(value, DTensor):
        return value
    mesh = value.device_mesh
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    placements = [
        Shard(0) if value.ndim and name == batch_dim_name else Replicate()
        for name in names
    ]
    return value.redistribute(mesh, placements).to_local()


def per_element_call(fn: Any, value: Any) -> DTensor | None:
    """``fn(value)`` on each rank's shard, for an op mapping each element alone
    (``one_hot``, which DTensor cannot trace); None for a Partial value."""
    if not isinstance(value, DTensor) or any(p.is_partial() for p in value.placements):
        return None
    local = fn(value.to_local())
    if local.ndim < value.ndim:
        return None
    placements = tuple(
        Shard(p.dim % value.ndim) if isinstance(p, Shard) else p
        for p in value.placements
    )
    shape = torch.Size((*value.shape, *local.shape[value.ndim :]))
    # contiguous, as the local result is
    stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
    mesh = value.device_mesh
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=shape, stride=stride
    )


def batch_parallel_call(
    fn: Any, value: Any, weights: Sequence[Any], mesh: Any
) -> DTensor:
    """``fn(value, *weights)`` per rank: weights gathered, ``value`` only batch-split (a
    convolution with sharded channels, which torch's rule mislabels); a weight's
    gradient is a Partial sum over the batch axes."""
    full = batch = (Replicate(),) * mesh.ndim
    if isinstance(value, DTensor):
        batch = tuple(
            Shard(0) if isinstance(p, Shard) and p.dim == 0 else Replicate()
            for p in value.placements
        )
        value = value.redistribute(mesh, batch).to_local(grad_placements=batch)
    weight_grads = tuple(Partial() if p == Shard(0) else p for p in batch)
    local = [
        w.redistribute(mesh, full).to_local(grad_placements=weight_grads)
        if isinstance(w, DTensor)
        else w
        for w in weights
    ]
    return DTensor.from_local(fn(value, *local), mesh, batch, run_check=False)


def update_in_place_of(
    inputs: Any, updates: Any
) -> tuple[Any, torch.Tensor, torch.Tensor, tuple] | None:
    """Local operands for writing ``updates`` into a copy of ``inputs`` (a KV cache's
    slice update, where DTensor refuses to change the target's placements): both take
    ``updates``' placements where it spans every sharded dim whole, else both are
    gathered. ``(mesh, inputs, updates, placements)``, or None without a DTensor."""
    partner = updates if isinstance(updates, DTensor) else inputs
    if not isinstance(partner, DTensor):
        return None
    mesh = partner.device_mesh
    inputs, updates = (
        v if isinstance(v, DTensor) else replicate(v, mesh) for v in (inputs, updates)
    )
    updates = reduce_partial(updates)
    placements = tuple(updates.placements)
    if not same_mesh(inputs.device_mesh, mesh) or any(
        isinstance(p, Shard) and updates.shape[p.dim] != inputs.shape[p.dim]
        for p in placements
    ):
        placements = (Replicate(),) * mesh.ndim
    local = [v.redistribute(mesh, placements).to_local() for v in (inputs, updates)]
    return mesh, local[0], local[1], placements


def gather_axes_splitting(table: Any, ids: Any) -> Any:
    """``table`` gathered on every mesh axis that also splits ``ids`` (FSDP-style 2-D
    layouts: DTensor's embedding rule failed with an IndexError)."""
    both = isinstance(table, DTensor) and isinstance(ids, DTensor)
    if not both or not same_mesh(table.device_mesh, ids.device_mesh):
        return table
    placements = tuple(
        Replicate() if isinstance(mine, Shard) and isinstance(theirs, Shard) else mine
        for mine, theirs in zip(table.placements, ids.placements, strict=True)
    )
    return redistributed(table, placements)


def gather_axis(value: Any, axis: int | None) -> Any:
    """``value`` gathered on the mesh axes that shard dim ``axis`` (None: all): an index
    reduction's rule reads a scalar back, a graph break."""
    if not isinstance(value, DTensor):
        return value
    dim = None if axis is None else axis % max(value.ndim, 1)
    placements = tuple(
        Replicate() if isinstance(p, Shard) and dim in (None, p.dim) else p
        for p in value.placements
    )
    if placements == tuple(value.placements):
        return value
    return placed(value, placements)
