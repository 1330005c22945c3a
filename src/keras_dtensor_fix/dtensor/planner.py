"""The one answer to "may this run on each rank's local tensors, and how?".

Pure decisions: meshes, placements and shapes in, a plan (or None: keep the DTensor
path) out. The rules for every kind: one mesh; a one-rank mesh axis holds everything; a
Partial value is a pending sum no local computation reads (except a caller reducing it
first, ``partial=True``); a plain tensor is the full value; ``gradients=False`` refuses
a value that needs one.

- ``replicated``: every operand whole; no collective out.
- ``region``: operands split alike on dims the computation does not read
  across (``mixes``); the result keeps their layout.
- ``product``: an einsum whose sharded letters are sharded alike; summed
  axes all-reduced on the way out.
- ``shardwise``: an elementwise update over operands split alike.
- ``split_axis``: a Megatron block's weights split on one mesh axis.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_dtensor_fix.dtensor.placement import effective, same_mesh

__all__ = [
    "Product",
    "aligned",
    "parse_equation",
    "product",
    "region",
    "replicated",
    "shard_dim",
    "shardwise",
    "split_axis",
    "split_dims",
    "whole",
]

Placements = tuple[Any, ...]


def split_dims(value: DTensor, *, partial: bool = False) -> frozenset[int] | None:
    """The dims ``value`` is split on over mesh axes of more than one rank; None for a
    Partial value unless ``partial``."""
    mesh, dims = value.device_mesh, set()
    for axis, placement in enumerate(value.placements):
        if placement.is_partial():
            if not partial:
                return None
        elif placement.is_shard() and mesh.size(axis) > 1:
            dims.add(placement.dim % value.ndim)
    return frozenset(dims)


def whole(value: Any) -> bool:
    """Whether DTensor ``value`` holds its full value on every rank."""
    return split_dims(value) == frozenset()


def _one_mesh(values: Sequence[Any], mesh: Any = None) -> Any:
    """The mesh every DTensor in ``values`` sits on (``mesh`` where given), or None:
    no DTensor, or two meshes."""
    for value in values:
        if isinstance(value, DTensor):
            if mesh is None:
                mesh = value.device_mesh
            elif not same_mesh(value.device_mesh, mesh):
                return None
    return mesh


def _plain_ok(value: Any, mesh: Any, gradients: bool) -> bool:
    """A tensor's device and gradient rules (a DTensor's device is its mesh's)."""
    if not isinstance(value, torch.Tensor):
        return True
    if not gradients and value.requires_grad and torch.is_grad_enabled():
        return False
    return not value.ndim or value.device.type == mesh.device_type


def replicated(
    values: Sequence[Any],
    *,
    mesh: Any = None,
    gradients: bool = True,
    partial: bool = False,
) -> Any | None:
    """The mesh when a computation on ``values`` may run whole on every rank (``mesh``:
    for calls that may hold no DTensor)."""
    mesh = _one_mesh(values, mesh)
    if mesh is None:
        return None
    for value in values:
        if isinstance(value, DTensor):
            if split_dims(value, partial=partial) != frozenset():
                return None
        elif isinstance(value, (list, tuple)):
            if any(isinstance(v, DTensor) for v in value):
                return None
        if not _plain_ok(value, mesh, gradients):
            return None
    return mesh


def region(
    values: Sequence[Any], mixes: frozenset[int] | None
) -> tuple[Any, Placements] | None:
    """``(mesh, placements)`` when a layer's computation may run locally.

    Every split operand split alike, every other tensor whole (or of size 1) along the
    split dims, none split on ``mixes`` (None: every DTensor whole)."""
    mesh = _one_mesh(values)
    if mesh is None:
        return None
    reference, split = None, frozenset()
    for value in values:
        if not isinstance(value, DTensor):
            continue
        dims = split_dims(value)
        if dims is None:
            return None
        if not dims:
            continue
        if mixes is None or dims & mixes:
            return None
        if reference is None:
            reference, split = value, dims
        elif value.shape != reference.shape or effective(value) != effective(reference):
            return None
    for value in values:
        if isinstance(value, DTensor):
            if split_dims(value):
                continue  # split as the reference is (checked above)
        elif not _plain_ok(value, mesh, gradients=True):
            return None
        if reference is not None and isinstance(value, torch.Tensor):
            offset = reference.ndim - value.ndim
            if any(d - offset >= 0 and value.shape[d - offset] != 1 for d in split):
                return None
    if reference is None:
        return mesh, (Replicate(),) * mesh.ndim
    return mesh, tuple(reference.placements)


def shardwise(values: Sequence[Any], states: Sequence[Any]) -> Any | None:
    """The mesh when an optimizer update may run on each rank's shards: values and slots
    DTensors on one mesh without Partial, scalars anything."""
    if not all(isinstance(v, DTensor) and split_dims(v) is not None for v in values):
        return None
    mesh = _one_mesh([*values, *states])
    if mesh is None or not values:
        return None
    for state in states:
        if isinstance(state, DTensor):
            if split_dims(state) is None:
                return None
        elif state is not None and getattr(state, "ndim", 0):
            return None
    return mesh


class Product(NamedTuple):
    """How an einsum runs locally: placements in and out, sums on the way out."""

    #: The local result's placements (``Partial`` where a letter is summed).
    placements: Placements
    #: Each operand's gradient placements.
    grads: tuple[Placements, ...]
    #: Mesh axes whose Partial result is all-reduced to the total.
    summed: tuple[int, ...]


def parse_equation(equation: str) -> tuple[list[str], str] | None:
    """Operand subscripts and output of an explicit einsum equation without an ellipsis,
    or None."""
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    return inputs.split(","), output


@functools.lru_cache(maxsize=512)
def aligned(
    equation: str, placements: tuple[Placements, ...], mesh_shape: tuple[int, ...]
) -> tuple[Placements, ...]:
    """The operands' placements for :func:`product`: the collectives on the way in.

    Operands sharding different letters on one mesh axis: the first keeps its letter,
    the others are gathered there (FSDP's all-gather). Then a replicated operand is
    split where another shards a letter it holds (its own slice, no communication)."""
    parsed = parse_equation(equation)
    if parsed is None or len(parsed[0]) != len(placements):
        return placements
    subscripts = parsed[0]
    wanted = [list(p) for p in placements]
    for axis, size in enumerate(mesh_shape):
        letters = {
            i: subscripts[i][p.dim]
            for i, p in enumerate(held[axis] for held in placements)
            if type(p) is Shard and p.dim < len(subscripts[i])
        }
        if size > 1 and letters:
            keep = next(iter(letters.values()))
            for i in [i for i, letter in letters.items() if letter != keep]:
                wanted[i][axis] = Replicate()
                del letters[i]
        if len(set(letters.values())) != 1:
            continue
        (letter,) = set(letters.values())
        for i, held in enumerate(subscripts):
            if wanted[i][axis].is_replicate() and letter in held:
                wanted[i][axis] = Shard(held.index(letter))
    return tuple(tuple(w) for w in wanted)


@functools.lru_cache(maxsize=512)
def product(
    equation: str,
    shapes: tuple[tuple[int, ...], ...],
    placements: tuple[Placements, ...],
    mesh_shape: tuple[int, ...],
) -> Product | None:
    """The local form of ``einsum(equation, ...)`` on operands so placed, or None.

    Each mesh axis is replicated everywhere or shards one letter in every operand
    holding it: the output is sharded on it, or Partial where it is summed. None for an
    ellipsis, a repeated or broadcast letter, Partial, uneven shards or two letters on
    one axis."""
    parsed = parse_equation(equation)
    if parsed is None:
        return None
    subscripts, output = parsed
    if len(subscripts) != len(shapes) or len(set(output)) != len(output):
        return None
    sizes: dict[str, int] = {}
    for letters, shape in zip(subscripts, shapes, strict=True):
        if len(letters) != len(shape) or len(set(letters)) != len(letters):
            return None
        for letter, size in zip(letters, shape, strict=True):
            if sizes.setdefault(letter, size) != size:
                return None  # a broadcast letter: its gradient needs a sum
    out: list[Any] = []
    grads: list[list[Any]] = [[] for _ in subscripts]
    for axis, size in enumerate(mesh_shape):
        holders: dict[str, list[int]] = {}
        for i, letters in enumerate(subscripts):
            placement = placements[i][axis]
            if size == 1 or placement.is_replicate():
                continue  # a one-rank axis holds everything
            if type(placement) is not Shard or not 0 <= placement.dim < len(letters):
                return None
            if shapes[i][placement.dim] % size:
                return None
            holders.setdefault(letters[placement.dim], []).append(i)
        if not holders:
            out.append(Replicate())
            for i, grad in enumerate(grads):
                grad.append(placements[i][axis])
            continue
        if len(holders) > 1:
            return None
        ((letter, sharded),) = holders.items()
        if any(letter in s and i not in sharded for i, s in enumerate(subscripts)):
            return None
        out.append(Shard(output.index(letter)) if letter in output else Partial())
        for i, grad in enumerate(grads):
            grad.append(placements[i][axis] if i in sharded else Partial())
    summed = tuple(axis for axis, p in enumerate(out) if p.is_partial())
    return Product(tuple(out), tuple(tuple(g) for g in grads), summed)


def split_axis(values: Sequence[DTensor]) -> tuple[Any, int] | None:
    """``(mesh, axis)``: the one mesh axis (of more than one rank) ``values`` are split
    on, each on at most one dim; else None."""
    mesh = _one_mesh(values)
    if mesh is None:
        return None
    axes = set()
    for value in values:
        split = {i: p for i, p in enumerate(effective(value)) if not p.is_replicate()}
        if len(split) > 1 or not all(isinstance(p, Shard) for p in split.values()):
            return None
        axes.update(split)
    return (mesh, axes.pop()) if len(axes) == 1 else None


def shard_dim(value: DTensor, axis: int) -> int | None:
    """The tensor dim ``value`` is split on along mesh ``axis`` (None: whole)."""
    placement = value.placements[axis]
    return placement.dim % value.ndim if isinstance(placement, Shard) else None
