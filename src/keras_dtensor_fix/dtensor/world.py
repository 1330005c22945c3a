"""This process's rank and world size; rank 0 of 1 without a process group."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["distributed", "rank", "world"]


def distributed() -> bool:
    """Whether a default process group is up."""
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank in the default group (0 without one)."""
    return dist.get_rank() if distributed() else 0


def world() -> int:
    """How many processes the default group has (1 without one)."""
    return dist.get_world_size() if distributed() else 1
