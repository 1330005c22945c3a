"""The store exchange: calls every process makes, and one process acting for all.

A save called on one process only (``if rank == 0: model.save(...)``) would
wait in a gather until the group's timeout (30 minutes on gloo), saying
nothing useful; an exchange through the group's key-value store (no
collective, any backend) names the missing processes instead. Pure torch.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from keras_dtensor_fix.engine import config

#: How long a process waits for the others before the handshake fails.
SECONDS = 60.0

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()
_local = threading.local()


def store() -> Any:
    """The group's store; off the main thread a clone, so that a thread's
    exchange never queues behind the main thread's blocked wait."""
    import torch.distributed as dist

    default = dist.distributed_c10d._get_default_store()
    if threading.current_thread() is threading.main_thread():
        return default
    if (mine := getattr(_local, "store", None)) is None or mine[0] is not default:
        mine = _local.store = (default, default.clone())
    return mine[1]


class MissingProcessesError(RuntimeError):
    """Not every process made a call that needs all of them."""

    def __init__(self, message: str, missing: list[int]) -> None:
        super().__init__(message)
        self.missing = missing


def exchange(
    what: str, value: str, hint: str, seconds: float | None = None
) -> list[str]:
    """Every process's ``value`` for this call of ``what``, indexed by rank.

    The n-th call on one process meets the n-th on the others; processes
    missing after ``seconds`` raise :class:`MissingProcessesError` (``hint``
    says what to do).
    """
    from keras_dtensor_fix.dtensor import world as place

    if (world := place.world()) == 1:
        return [value]
    rank = place.rank()
    with _lock:
        count = _counts[what]
        _counts[what] += 1
    shared = store()
    keys = [f"keras_dtensor_fix/{what}/{count}/{r}" for r in range(world)]
    shared.set(keys[rank], value.encode())
    wait = SECONDS if seconds is None else seconds
    try:
        shared.wait(keys, timedelta(seconds=wait))
    except Exception:  # noqa: BLE001 - the store's timeout error varies by version
        missing = [r for r in range(world) if not shared.check([keys[r]])]
        # Take this arrival back: the next call meets again under one count.
        shared.delete_key(keys[rank])
        with _lock:
            _counts[what] -= 1
        raise MissingProcessesError(
            f"keras-dtensor-fix: {what} was called on process {rank} but not on "
            f"process(es) {missing} within {wait:g} s. {hint}",
            missing,
        ) from None
    return [shared.get(key).decode() for key in keys]


def one_acts(
    what: str,
    act: Callable[[], Any] | None,
    hint: str,
    failure: Callable[[str], Exception],
    *,
    note: str = "",
    own: bool = False,
) -> list[Any]:
    """``act()`` where given (one process acts, or each); all learn every outcome.

    Every process calls it in the same order, waiting for the others up to
    the save timeout (``config.save_seconds``); returns the (JSON) results by
    rank. A failure anywhere raises ``failure(listing)`` everywhere, naming
    each failed process (``note`` after its number); with ``own``, a process
    that failed raises its own error instead.
    """
    result, error, text = None, None, None
    if act is not None:
        try:
            result = act()
            json.dumps(result)  # what the others cannot read fails here
        except Exception as exc:  # noqa: BLE001 - every process learns it
            result, error, text = None, exc, f"{type(exc).__name__}: {exc}"
    mine = json.dumps({"note": note, "error": text, "result": result})
    seconds = config.save_seconds()
    found = [json.loads(o) for o in exchange(f"{what} (outcome)", mine, hint, seconds)]
    if own and error is not None:
        raise error
    failed = "; ".join(
        f"process {r}{o['note']}: {o['error']}"
        for r, o in enumerate(found)
        if o["error"]
    )
    if failed:
        raise failure(failed) from error
    return [o["result"] for o in found]
