"""A tensor-parallel block on local tensors (Megatron's layout), pure torch: its inputs
cut to one rank's part (``local_part``) and the placements of what it returns
(``with_split``). The Keras side is ``generation/decoder.py``."""

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
    """This rank's part of a block input, or None where it has no local form: whole
    along mesh ``axis`` (``dim`` None), or the rank's slice of ``dim``; a plain tensor
    beside a ``like`` split on other axes is cut as ``like`` on the batch dim."""
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
