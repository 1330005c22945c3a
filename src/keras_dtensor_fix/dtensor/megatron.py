"""A tensor-parallel block on local tensors: Megatron's layout, from placements.

A decoder block whose weights are split on one mesh axis only (column-parallel
products in, row-parallel products out) computes on each rank's local
tensors with one all-reduce after each row-parallel product, as Megatron's
decoder does: its input is whole on that axis, its attention runs on the
rank's own heads, and its key/value cache stays split by heads. This module
cuts a block's inputs to one rank's part (``local_part``) and names the
placements of what it returns (``with_split``); whether the block's weights
are split so is the planner's (``planner.split_axis``). Pure torch: the
Keras side is ``generation/decoder.py``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Replicate, Shard

from keras_dtensor_fix.dtensor.placement import same_mesh
from keras_dtensor_fix.dtensor.planner import shard_dim


def local_part(
    value: Any, mesh: Any, axis: int, dim: int | None, like: DTensor | None = None
) -> Any:
    """This rank's part of a block input, or None where it has no local form.

    ``dim`` None: the value must be whole along mesh ``axis`` (a replicated
    DTensor, whatever its other axes hold, or a plain tensor). Otherwise the
    rank's slice of ``dim`` along ``axis``: a DTensor split there already, or
    a replicated one or a plain tensor cut to it. A plain tensor beside a
    ``like`` (the block's input) split on other mesh axes is cut as ``like``
    on dim 0 (the batch) when ``dim`` is given (a cache); any other such
    plain tensor has no known local form (a scalar has one: itself).
    """
    if isinstance(value, DTensor):
        if not same_mesh(value.device_mesh, mesh):
            return None
        have = shard_dim(value, axis)
        if have == dim:
            return value.to_local()
        if have is not None:
            return None
        return _cut(value.to_local(), mesh, axis, dim)
    if not isinstance(value, torch.Tensor) or value.ndim == 0:
        return value
    if like is not None:
        for i, placement in enumerate(like.placements):
            if i == axis or not isinstance(placement, Shard) or mesh.size(i) == 1:
                continue
            if dim is None or placement.dim % like.ndim != 0:
                return None
            value = _cut(value, mesh, i, 0)
            if value is None:
                return None
    return _cut(value, mesh, axis, dim)


def _cut(value: torch.Tensor, mesh: Any, axis: int, dim: int | None) -> Any:
    if dim is None:
        return value
    size = mesh.size(axis)
    if dim >= value.ndim or value.shape[dim] % size:
        return None
    chunk = value.shape[dim] // size
    return value.narrow(dim, mesh.get_local_rank(axis) * chunk, chunk)


def with_split(
    like: DTensor | None, mesh: Any, axis: int, dim: int | None
) -> tuple[Any, ...]:
    """``like``'s placements (all Replicate without one), split on ``dim``
    along mesh ``axis`` (whole there for ``dim`` None)."""
    base = like.placements if like is not None else (Replicate(),) * mesh.ndim
    return tuple(
        (Replicate() if dim is None else Shard(dim)) if i == axis else p
        for i, p in enumerate(base)
    )
