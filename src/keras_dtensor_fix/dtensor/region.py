"""When a whole computation may run on each rank's local tensors.

A computation whose DTensor operands are all replicated (mesh axes of one rank
count as replicated) computes the same full value on every rank: it can run on
the local tensors, and its result is wrapped once as a Replicate DTensor. One
that mixes values only along some dims (``mixes``: a norm's feature axis, a
rotary embedding's sequence and feature axes) can also run on shards split on
the other dims, as long as every sharded operand is split the same way and
every other operand is whole along the split dims (size 1 there: a mask
broadcast over heads). Gradients are exact: each rank's local backward is the
backward of its own piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from keras_dtensor_fix.dtensor.local import unwrap_local
from keras_dtensor_fix.dtensor.placement import same_mesh


def split_dims(value: DTensor) -> frozenset[int] | None:
    """The dims ``value`` is split on over mesh axes of more than one rank.

    None for a Partial value (a pending sum no local computation may read).
    """
    mesh, dims = value.device_mesh, set()
    for axis, placement in enumerate(value.placements):
        if placement.is_partial():
            return None
        if placement.is_shard() and mesh.size(axis) > 1:
            dims.add(placement.dim % value.ndim)
    return frozenset(dims)


def local_region(
    values: Sequence[Any], mixes: frozenset[int] | None
) -> tuple[Any, tuple, list[Any]] | None:
    """``(mesh, placements, locals)`` when the computation may run locally.

    ``values`` are the leaves of the call's arguments; ``mixes`` the dims the
    computation reads across (None: unknown, so every DTensor must be
    replicated). The locals are ``unwrap_local``'s (an autograd op where a
    gradient is wanted). ``placements`` are what a result with the operands' shape
    gets: the sharded operands' placements, or Replicate everywhere. None when
    there is no DTensor, two meshes, a Partial value or a split the
    computation would read across.
    """
    mesh, reference, split = None, None, frozenset()
    for value in values:
        if not isinstance(value, DTensor):
            continue
        if mesh is None:
            mesh = value.device_mesh
        elif not same_mesh(value.device_mesh, mesh):
            return None
        dims = split_dims(value)
        if dims is None:
            return None
        if not dims:
            continue
        if mixes is None:
            return None
        if reference is None:
            reference, split = value, dims
        elif (
            value.ndim != reference.ndim
            or tuple(value.placements) != tuple(reference.placements)
            or value.shape != reference.shape
        ):
            return None
    if mesh is None:
        return None
    if reference is not None:
        if split & mixes:
            return None
        for value in values:  # every other operand whole along the split dims
            if value is reference or not isinstance(value, torch.Tensor):
                continue
            if isinstance(value, DTensor) and split_dims(value):
                continue  # split as the reference is (checked above)
            offset = reference.ndim - value.ndim
            if any(d - offset >= 0 and value.shape[d - offset] != 1 for d in split):
                return None
        placements = tuple(reference.placements)
    else:
        placements = (Replicate(),) * mesh.ndim
    local = [unwrap_local(v) if isinstance(v, DTensor) else v for v in values]
    return mesh, placements, local
