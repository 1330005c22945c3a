"""Which process acts: rank, and "the first process acts, every process learns".

Collectives on the default process group; with none, one process is all.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from keras_dtensor_fix.checkpoint.files import CheckpointError
from keras_dtensor_fix.dtensor.world import distributed, rank

__all__ = ["distributed", "from_first", "on_first", "rank"]


def from_first(value: Any) -> Any:
    """``value`` as the first process has it (every process calls this)."""
    if not distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def on_first(fn, *args: Any) -> Any:
    """Run ``fn`` on the first process; all return its result or raise its error.

    The other processes wait for it: a broadcast is a barrier that carries
    the first process's failure too, so none hangs on an error.
    """
    result, error = None, None
    if rank() == 0:
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - re-raised on every process
            error = exc
    outcome = from_first((result, None if error is None else repr(error)))
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise CheckpointError(f"the first process failed: {outcome[1]}")
    return outcome[0]
