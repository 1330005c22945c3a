"""Preemption: a signal, then every process stops at the same step and saves it.

A scheduler sends SIGTERM (SLURM with ``--signal``: another one the user
names) and kills the job after a grace period; torchrun forwards it to every
worker, or only one process may get it. The handler only notes the signal,
starts a deadline and wakes a watcher thread. The threads, one per process,
agree through the process group's store (a clone of it: no collective, and
nothing the main thread's blocking store calls can hold up), whatever the
main threads are doing: a step, validation, a data wait, a callback, a save.

The agreement: the first thread to see a signal writes it under one key
(``compare_set``: a finished ``fit`` writes ``end`` there instead, so a
signal and the end cannot both win); every thread polls that key every
:data:`POLL` seconds. Each then offers how far its main thread will get
without starting anything new: the steps it has finished (plus the one it is
in) and the saves it has begun. The stop is the largest of each; a main
thread behind goes on to it, one there waits at its next step boundary, and
none starts a step or a save beyond it (the gates, :meth:`Watcher.begin_step`
and :meth:`Watcher.begin_save`). Once its main thread has finished the stop
step and every agreed save, each thread saves (its collectives on a gloo
group of its own) and ends the process: the weights do not change outside a
step, so the main thread may be anywhere else. When the deadline passes
first, the process exits on its own, naming the checkpoint it leaves. A
signal once the watched call (``fit``) has left the stack without ending the
watch (it raised: Keras calls no ``on_train_end``) goes to the handler that
was there before, put back.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable
from datetime import timedelta
from types import CodeType, FrameType
from typing import Any

import torch.distributed as dist

#: Seconds from the signal to the process's exit, save included: well inside
#: the 30 s torchrun (and most schedulers) wait before SIGKILL.
DEFAULT_TIMEOUT = 20.0
#: Seconds between a thread's looks at the store: a signal on another process
#: is known within about this long. One look is a store round trip made with
#: the GIL released, a few hundredths of a percent of the time.
POLL = 0.25

#: Each watch's keys apart from the previous one's (every process counts alike).
_watches = itertools.count()


def exit_code(signum: int) -> int:
    """What a shell reports for a process killed by ``signum``."""
    return 128 + signum


def leave(code: int, message: str) -> None:
    """Print ``message`` and end the process now (no interpreter teardown).

    Teardown right after gloo collectives can abort the process (a worker
    thread releasing tensors while the interpreter finalizes), which would
    turn a clean preemption into SIGABRT.
    """
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


#: What the watcher calls, on its thread, to save the stop: the signal in,
#: a line naming what was saved out.
Saver = Callable[[int], str]


class Watcher:
    """Notes ``signals`` during ``fit``; every process stops at one step."""

    def __init__(self, signals: Iterable[int], timeout: float) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.timeout = timeout
        self.received: int | None = None  # this process's signal
        self.where = "no checkpoint yet"  # what a deadline exit names
        self.group: Any = None  # the threads' saves' collectives
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._within: CodeType | None = None
        self._cond = threading.Condition()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._save: Saver | None = None
        self._store: Any = None  # the thread's clone of the group's store
        self._keys = ""
        # The main thread's progress, read by the thread under _cond.
        self._done = self._saves = 0  # steps finished, saves begun
        self._busy = self._saving = False  # inside a step, inside a save
        self._signum: int | None = None  # the agreed signal
        self._stop: tuple[int, int] | None = None  # agreed (steps, saves)
        self._over = False  # fit ended: the thread leaves

    # ------------------------------------------------------------ life

    def start(self, save: Saver, within: CodeType | None = None, done: int = 0) -> None:
        """Install the handlers (main thread only), the group and the thread.

        ``save`` runs on the thread once this process reached the stop;
        ``within``: the code of the call being watched (``fit``), a signal
        while no frame of it is on the stack is not this watch's; ``done``:
        the steps already finished (a resumed ``fit``).
        """
        self._end_thread()  # a fit that raised left its watch on
        self._within, self._save = within, save
        self._done, self._saves, self._over = done, 0, False
        self._signum = self._stop = self._timer = self.received = None
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
            import warnings

            warnings.warn(
                "Checkpoint: fit() runs outside the main thread, where Python "
                "cannot handle signals: preemption is not watched",
                stacklevel=3,
            )
            self.signals = ()
            return
        for signum in self.signals:
            if signum not in self._previous:
                self._previous[signum] = signal.signal(signum, self._handle)
        if dist.is_initialized() and dist.get_world_size() > 1:
            if self.group is None:
                self.group = dist.new_group(backend="gloo")  # every process, in step
            self._store = dist.distributed_c10d._get_default_store().clone()
            self._keys = f"keras_dtensor_fix/preemption/{next(_watches)}"
        self._thread = threading.Thread(
            target=self._watch, name="keras_dtensor_fix preemption", daemon=True
        )
        self._thread.start()

    def held(self) -> threading.Condition:
        """Hold it (``with``) while changing what the thread's save reads."""
        return self._cond

    def watching(self) -> bool:
        """Whether a watch is on (started with signals, not stopped)."""
        return self._thread is not None

    def stop(self) -> None:
        """At ``fit``'s end, every process: stop here if a signal wins, else
        end the watch and put the previous handlers back (a signal noted
        after the end is handed to them)."""
        if not self.signals:
            return
        self.gate()
        if self._store is not None:
            store = self._store.clone()  # the thread's may be in a call
            store.set(self._key(f"end/{dist.get_rank()}"), b"1")
            everyone = [self._key(f"end/{r}") for r in range(dist.get_world_size())]
            store.wait(everyone, timedelta(seconds=max(self.timeout, 60.0)))
            fate = store.compare_set(self._key("fate"), "", "end")
            if fate != b"end":
                self.gate(signum=int(fate))  # a signal came first: it parks
        elif self.received is not None:
            self.gate(signum=self.received)
        self._end_thread()
        late = self.received
        self._put_back_and(late)

    def _end_thread(self) -> None:
        with self._cond:
            self._over = True
            self._cond.notify_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._wake.clear()

    def _put_back_and(self, late: int | None) -> None:
        previous = self._previous.get(late) if late is not None else None
        self._put_back()
        if late is not None:
            if self._timer is not None:
                self._timer.cancel()
            self.received = None
            if callable(previous):
                previous(late, sys._getframe(1))
            elif previous != signal.SIG_IGN:
                signal.raise_signal(late)

    # ------------------------------------------------------------ main thread

    def begin_step(self) -> None:
        """Before a training step: wait or stop here if the stop is reached."""
        with self._cond:
            self._pass()
            self._busy = True

    def end_step(self) -> None:
        """After a training step."""
        with self._cond:
            self._done += 1
            self._busy = False
            self._cond.notify_all()

    def begin_save(self) -> None:
        """Before the callback's own save: go on only if no process has
        stopped before it (then every process makes it)."""
        with self._cond:
            if self._signum is not None or self.received is not None:
                self._agreed()
                if self._saves >= self._stop[1]:
                    self._park()
            self._saves += 1
            self._saving = True

    def end_save(self) -> None:
        with self._cond:
            self._saving = False
            self._cond.notify_all()

    def gate(self, signum: int | None = None) -> None:
        """Where nothing runs (between steps, after a save): stop if due.

        ``signum``: one known to have won (the end's ``compare_set``).
        """
        if signum is None and self._signum is None and self.received is None:
            return
        with self._cond:
            self._pass(known=signum is not None)

    def _pass(self, known: bool = False) -> None:
        """(under _cond) Wait for the stop once a signal is known; park at it."""
        if not known and self._signum is None and self.received is None:
            return
        self._agreed()
        if self._done >= self._stop[0] and self._saves >= self._stop[1]:
            self._park()

    def _agreed(self) -> None:
        self._wake.set()
        self._cond.wait_for(lambda: self._stop is not None)

    def _park(self) -> None:
        """Let the thread save; it ends the process (or the deadline does)."""
        self._cond.notify_all()
        while True:
            self._cond.wait()

    # ------------------------------------------------------------ the thread

    def _key(self, name: str) -> str:
        return f"{self._keys}/{name}"

    def _watch(self) -> None:
        while True:
            self._wake.wait(POLL)
            self._wake.clear()
            with self._cond:
                if self._over:
                    return
            try:
                signum = self._signal()
            except Exception:  # noqa: BLE001 - the group is gone: fit has ended
                return
            if signum is not None:
                break
        self._signum = signum
        if self._timer is None:
            self._arm()
        with self._cond:
            mine = (self._done + self._busy, self._saves)
        stop = self._offer(mine)
        with self._cond:
            self._stop = stop
            self._cond.notify_all()
            self._cond.wait_for(
                lambda: (
                    not self._busy
                    and not self._saving
                    and self._done >= stop[0]
                    and self._saves >= stop[1]
                )
            )
            # Saved holding the lock: the main thread, wherever it is, changes
            # nothing the save reads (its hooks take the lock to).
            try:
                saved = self._save(signum)
            except BaseException as exc:  # noqa: BLE001 - the process ends anyway
                leave(
                    exit_code(signum),
                    f"keras_dtensor_fix: {signal.Signals(signum).name}: the save "
                    f"at the stop failed ({exc!r}); the newest complete "
                    f"checkpoint is {self.where}",
                )
            leave(exit_code(signum), saved)

    def _signal(self) -> int | None:
        """The signal any process got (this one's offered first), or None."""
        if self._store is None:
            return self.received
        fate = self._key("fate")
        if self.received is not None:
            value = self._store.compare_set(fate, "", str(self.received))
        elif self._store.check([fate]):
            value = self._store.get(fate)
        else:
            return None
        if value == b"end":  # fit ended first: no stop
            with self._cond:
                self._cond.wait_for(lambda: self._over)
            sys.exit()  # this thread only
        return int(value)

    def _offer(self, mine: tuple[int, int]) -> tuple[int, int]:
        """Every process's (steps, saves) reach; the largest of each."""
        if self._store is None:
            return mine
        rank, world = dist.get_rank(), dist.get_world_size()
        self._store.set(self._key(f"reach/{rank}"), f"{mine[0]},{mine[1]}")
        keys = [self._key(f"reach/{r}") for r in range(world)]
        self._store.wait(keys, timedelta(seconds=self.timeout))
        offers = [tuple(int(v) for v in self._store.get(k).split(b",")) for k in keys]
        return max(o[0] for o in offers), max(o[1] for o in offers)

    # ------------------------------------------------------------ signals

    def _handle(self, signum: int, frame: Any) -> None:
        if self._within is not None and not _on_stack(frame, self._within):
            self._hand_back(signum, frame)
            return
        if self.received is not None:
            return
        self.received = signum
        if self._timer is None:
            self._arm()
        self._wake.set()

    def _arm(self) -> None:
        self._timer = threading.Timer(self.timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()

    def _hand_back(self, signum: int, frame: Any) -> None:
        """Put the previous handlers back and give them this signal."""
        previous = self._previous.get(signum)
        self._put_back()
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            signal.raise_signal(signum)  # the default action, as if never caught

    def _put_back(self) -> None:
        """Reinstall the handlers :meth:`start` replaced (one not set from
        Python, None, as the default)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _expire(self) -> None:
        signum = self.received or self._signum or signal.SIGTERM
        leave(
            exit_code(signum),
            f"keras_dtensor_fix: {signal.Signals(signum).name} received, and no "
            f"step was saved within {self.timeout:g} s (Checkpoint's "
            f"preemption_timeout): exiting; the newest complete checkpoint is "
            f"{self.where}",
        )


def _on_stack(frame: FrameType | None, code: CodeType) -> bool:
    """Whether a frame running ``code`` is ``frame`` or one of its callers."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
