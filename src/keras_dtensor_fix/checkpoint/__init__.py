"""Sharded checkpoints of Keras models with ``torch.distributed.checkpoint``.

Each process writes only its own shards; :func:`load` reads into the model's
current placements, whatever mesh saved it. Modules: ``files`` (the directory,
atomic commits), ``processes`` (which process acts), ``sharded`` (:func:`save`,
:func:`load`), ``position`` (where ``fit`` is in its data), ``preemption``
(every process stopping at one step), ``callback`` (``Checkpoint``). Names load
on first use, so the ``resume`` family imports ``position`` without DCP.
"""

from __future__ import annotations

import importlib
from typing import Any

_HOME = {
    "Checkpoint": "callback",
    "CheckpointDirectoryError": "files",
    "CheckpointError": "files",
    "CheckpointMismatchError": "sharded",
    "PendingSave": "sharded",
    "load": "sharded",
    "save": "sharded",
}
__all__ = [
    "Checkpoint",
    "CheckpointDirectoryError",
    "CheckpointError",
    "CheckpointMismatchError",
    "PendingSave",
    "load",
    "save",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
