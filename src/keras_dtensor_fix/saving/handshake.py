"""Make a call that every process must make fail fast when only some make it.

Keras gathers each sharded variable with a collective when it saves; called on
one process only (``if rank == 0: model.save(...)``, the habit from data
parallel training), the gather waits for the other processes until the process
group's timeout (30 minutes on gloo) and then dies with a message that does
not say why. A handshake through the process group's key-value store, which
needs no collective and works on every backend, turns that into an error that
names the missing processes and what to do. Pure torch.
"""

from __future__ import annotations

import collections
import threading
from datetime import timedelta

#: How long a process waits for the others before the handshake fails.
SECONDS = 60.0

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()


class MissingProcessesError(RuntimeError):
    """Not every process made a call that needs all of them."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def exchange(
    what: str, value: str, hint: str, seconds: float | None = None
) -> list[str]:
    """Every process's ``value`` for this call of ``what``, indexed by rank.

    The n-th call on one process meets the n-th call on the others. Raises
    :class:`MissingProcessesError` naming the processes that did not arrive
    within ``seconds`` (default :data:`SECONDS`); ``hint`` says what to do.
    Without a process group of several processes: ``[value]``.
    """
    import torch.distributed as dist

    from keras_dtensor_fix.dtensor import world as place

    world = place.world()
    if world == 1:
        return [value]
    rank = place.rank()
    with _lock:
        count = _counts[what]
        _counts[what] += 1
    store = dist.distributed_c10d._get_default_store()
    prefix = f"keras_dtensor_fix/{what}/{count}"
    keys = [f"{prefix}/{r}" for r in range(world)]
    store.set(keys[rank], value.encode())
    wait = SECONDS if seconds is None else seconds
    try:
        store.wait(keys, timedelta(seconds=wait))
    except Exception:  # noqa: BLE001 - the store's timeout error varies by version
        missing = [r for r in range(world) if not store.check([keys[r]])]
        # Take this arrival back, so that the next call on every process
        # meets again under one count.
        store.delete_key(keys[rank])
        with _lock:
            _counts[what] -= 1
        raise MissingProcessesError(
            f"keras-dtensor-fix: {what} was called on process {rank} but not on "
            f"process(es) {missing} within {wait:g} s. {hint}",
            missing,
        ) from None
    return [store.get(key).decode() for key in keys]
