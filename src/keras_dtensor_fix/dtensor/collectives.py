"""The one all-reduce path (c10d, polled on CPU eagerly), generation's all-gather of
logits and ``all_gather_ints``."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

import torch

# The package, where POLL_SECONDS lives (read at each call, not copied).
import keras_dtensor_fix.dtensor as _package


def all_reduce_sum(value: torch.Tensor, mesh: Any, axes: Sequence[int]) -> torch.Tensor:
    """Sum a plain tensor over ``mesh`` axes ``axes``; autograd sees the identity
    (Megatron's row-parallel "g")."""
    if torch.is_grad_enabled() and value.requires_grad:
        return _AllReduceSum.apply(value, mesh, tuple(axes))
    return all_reduce_copy(value, mesh, axes)


def all_reduce_copy(
    value: torch.Tensor, mesh: Any, axes: Sequence[int]
) -> torch.Tensor:
    value = value.clone(memory_format=torch.contiguous_format)
    shape = mesh.shape
    for axis in axes:
        if shape[axis] > 1:  # a sum over one rank is its own value
            _reduce_in_place(value, mesh.get_group(axis))
    return value


def all_reduce_sums(values: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """``values`` summed over ``group``: one all-reduce per dtype."""
    out = list(values)
    for dtype in dict.fromkeys(v.dtype for v in values):
        picked = [i for i, v in enumerate(values) if v.dtype == dtype]
        flat = torch.cat([values[i].reshape(-1) for i in picked])
        _reduce_in_place(flat, group)
        sizes = [values[i].numel() for i in picked]
        for i, part in zip(picked, flat.split(sizes), strict=True):
            out[i] = part.reshape(values[i].shape)
    return out


def all_gather_last(value: torch.Tensor, mesh: Any, axis: int) -> torch.Tensor:
    """Every rank's ``value`` side by side along its last dim, in mesh ``axis`` order:
    vocabulary-split logits made whole."""
    size = mesh.size(axis)
    if size == 1:
        return value
    value = value.contiguous()
    group = mesh.get_group(axis)
    if torch.compiler.is_compiling():  # a graph's collective: no polling
        from torch.distributed import _functional_collectives as funcol

        gathered = funcol.all_gather_tensor(value, 0, group)
        return torch.cat(torch.chunk(gathered, size, dim=0), dim=-1)
    parts = [torch.empty_like(value) for _ in range(size)]
    _wait(torch.distributed.all_gather(parts, value, group=group, async_op=True), value)
    return torch.cat(parts, dim=-1)


def all_gather_ints(values: Sequence[int]) -> list[list[int]]:
    """Every process's ``values``, indexed by rank, over the default group (on
    the CPU for gloo, else on this process's GPU)."""
    gloo = "gloo" in str(torch.distributed.get_backend())
    device = "cpu" if gloo or not torch.cuda.is_available() else "cuda"
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    parts = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    _wait(torch.distributed.all_gather(parts, mine, async_op=True), mine)
    return [part.tolist() for part in parts]


def _reduce_in_place(value: torch.Tensor, group: Any) -> None:
    """The one all-reduce (sum) path: polled on CPU eagerly, traced as is."""
    if torch.compiler.is_compiling():
        torch.distributed.all_reduce(value, group=group)
        return
    _wait(torch.distributed.all_reduce(value, group=group, async_op=True), value)


def _wait(work: Any, value: torch.Tensor) -> None:
    """``work.wait()``, polled first where ``value`` is on the CPU (gloo)."""
    if value.device.type == "cpu":
        poll_work(work)
    work.wait()


def poll_work(work: Any) -> None:
    """Wait for gloo work by polling it, yielding the core between polls.

    A thread blocked on the work leaves its core idle, and waking it took most of the
    wait on a VM. Polling stops after ``POLL_SECONDS``; ``work.wait()`` then blocks (and
    raises a failure)."""
    deadline = time.perf_counter() + _package.POLL_SECONDS
    while not work.is_completed() and time.perf_counter() < deadline:
        _yield()


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, mesh: Any, axes: tuple) -> torch.Tensor:
        return all_reduce_copy(value, mesh, axes)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
        return grad, None, None
