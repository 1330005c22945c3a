"""The store exchange: calls every process makes, and one process acting for all.

Keras gathers each sharded variable with a collective when it saves; called on
one process only (``if rank == 0: model.save(...)``, the habit from data
parallel training), the gather waits for the other processes until the process
group's timeout (30 minutes on gloo) and then dies with a message that does
not say why. A handshake through the process group's key-value store, which
needs no collective and works on every backend, turns that into an error that
names the missing processes and what to do. On it stands the one protocol for
"one process acts, every process learns the outcome" (:func:`one_acts`): Keras
saves written by one process per path, and the sharded checkpoints' folder
made, committed and checked by the first. Pure torch.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

#: How long a process waits for the others before the handshake fails.
SECONDS = 60.0

_counts: collections.Counter[str] = collections.Counter()
_lock = threading.Lock()
_local = threading.local()


def _store() -> Any:
    """The group's store; on a thread other than the main one, a clone of it.

    One store client serves one call at a time: a thread's exchange (a
    preemption's save) must not queue behind a main thread's blocked wait.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    if threading.current_thread() is threading.main_thread():
        return store
    mine = getattr(_local, "store", None)
    if mine is None or mine[0] is not store:
        mine = _local.store = (store, store.clone())
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

    The n-th call on one process meets the n-th call on the others. Raises
    :class:`MissingProcessesError` naming the processes that did not arrive
    within ``seconds`` (default :data:`SECONDS`); ``hint`` says what to do.
    Without a process group of several processes: ``[value]``.
    """
    from keras_dtensor_fix.dtensor import world as place

    world = place.world()
    if world == 1:
        return [value]
    rank = place.rank()
    with _lock:
        count = _counts[what]
        _counts[what] += 1
    store = _store()
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


class Outcomes(NamedTuple):
    """What :func:`one_acts` brought back from every process, indexed by rank."""

    #: Each process's result (None where it did not act).
    results: list[Any]
    #: Each process's failure as ``"Type: message"``, or None.
    errors: list[str | None]
    #: Each process's ``note`` (what it acted on: a path).
    notes: list[str]
    #: This process's own failure, for chaining.
    error: BaseException | None

    def failed(self) -> list[tuple[int, str, str]]:
        """``(rank, note, error)`` for every process whose act failed."""
        return [
            (peer, note, error)
            for peer, (note, error) in enumerate(
                zip(self.notes, self.errors, strict=True)
            )
            if error is not None
        ]


def one_acts(
    what: str,
    acting: bool,
    act: Callable[[], Any],
    hint: str,
    *,
    note: str = "",
    seconds: float | None = None,
) -> Outcomes:
    """``act()`` where ``acting``; every process learns every outcome.

    The one protocol for "one process acts, every process learns": each
    process calls it (in the same order as the others), acts or not, and
    then all exchange their outcomes through the store (:func:`exchange`: no
    collective, so a process that failed or never came is an error on the
    others, not a hang). ``act``'s result must be JSON-encodable; the caller
    raises what :meth:`Outcomes.failed` lists, in its own words.
    """
    result, error, failure = None, None, None
    if acting:
        try:
            result = act()
            json.dumps(result)  # what the others cannot read fails here
        except Exception as exc:  # noqa: BLE001 - every process learns it
            result, error, failure = None, exc, f"{type(exc).__name__}: {exc}"
    mine = json.dumps({"note": note, "error": failure, "result": result})
    found = [json.loads(o) for o in exchange(f"{what} (outcome)", mine, hint, seconds)]
    return Outcomes(
        [o["result"] for o in found],
        [o["error"] for o in found],
        [o["note"] for o in found],
        error,
    )
