"""Sharded checkpoints of Keras models with ``torch.distributed.checkpoint``.

Every process writes only its own shards of each variable (a DTensor's local
tensor; DCP writes a replicated value once), and :func:`load` reads into the
model's current placements, whatever mesh and number of processes saved it.
One process with no process group can save and load too. The ``Checkpoint``
callback saves during ``fit`` and resumes it at the step it saved, also when
the job is preempted.

The modules: ``files`` (the directory on disk, atomic commits), ``processes``
(which process acts), ``sharded`` (:func:`save`, :func:`load`), ``position``
(where ``fit`` is in its data), ``preemption`` (signals, and every process
stopping at one step), ``callback`` (``Checkpoint``). Names are loaded on
first use, so the ``resume`` family can import ``position`` without torch's
checkpointing.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Checkpoint",
    "CheckpointDirectoryError",
    "CheckpointError",
    "CheckpointMismatchError",
    "PendingSave",
    "load",
    "save",
]

_HOME = {
    "Checkpoint": "callback",
    "CheckpointDirectoryError": "files",
    "CheckpointError": "files",
    "CheckpointMismatchError": "sharded",
    "PendingSave": "sharded",
    "load": "sharded",
    "save": "sharded",
}


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
