"""Preemption: a signal, then every process stops at the same step and saves it.

The handler only notes the signal and wakes a watcher thread. The threads
agree through a clone of the group's store (no collective: the main threads
may be anywhere): the first signal is written under one key (``compare_set``;
a finished ``fit`` writes ``end`` there), then each offers the steps and
saves its main thread will reach without starting anything new; the stop is
the largest of each. Main threads go on to it and park; each thread saves
and ends its process, or a deadline ends it. A signal once ``fit`` has left
the stack goes to the handler that was there before.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterable, Iterator
from types import CodeType
from typing import Any

import torch.distributed as dist

from keras_dtensor_fix.saving import handshake

#: Seconds from the signal to the exit: inside torchrun's 30 s before SIGKILL.
DEFAULT_TIMEOUT = 20.0
#: Seconds between a thread's looks at the store (a cheap round trip).
POLL = 0.25

_watches = itertools.count()

HINT = "Every process must reach the agreed stop or the end of fit(); one did not."


def leave(code: int, message: str) -> None:
    """Print ``message`` and exit now (with 128 + the signal, as a shell
    reports a process it killed): teardown right after gloo collectives can
    abort the process (SIGABRT)."""
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


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
        self.cond = threading.Condition()  # held while changing what a save reads
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._save: Callable[[int], str] | None = None  # signal in, exit line out
        self._keys: str | None = None  # the store keys' prefix, with several processes
        # The main thread's progress, read under cond: steps finished (the
        # callback's count, across fits and resumes), saves begun.
        self.done = self._saves = 0
        self._busy = self._saving = False  # inside a step, inside a save
        self._signum: int | None = None  # the agreed signal
        self._stop: tuple[int, int] | None = None  # agreed (steps, saves)
        self._over = False  # fit ended: the thread leaves

    def start(self, save: Callable[[int], str], within: CodeType | None = None) -> None:
        """Install the handlers (main thread only), the group and the thread.

        ``within``: the watched call's code (``fit``), outside which a signal
        is not this watch's.
        """
        self._end_thread()  # a fit that raised left its watch on
        self._within, self._save = within, save
        self._saves, self._over = 0, False
        self._signum = self._stop = self._timer = self.received = None
        if not self.signals:
            return
        if threading.current_thread() is not threading.main_thread():
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
            self._keys = f"preemption {next(_watches)}: "
        self._thread = threading.Thread(
            target=self._watch, name="keras_dtensor_fix preemption", daemon=True
        )
        self._thread.start()

    def watching(self) -> bool:
        """Whether a watch is on (started with signals, not stopped)."""
        return self._thread is not None

    def stop(self) -> None:
        """At ``fit``'s end, every process: stop here if a signal won, else
        put the previous handlers back (handing them a late signal)."""
        if not self.signals:
            return
        self.gate()
        won = self.received is not None  # a signal came first: park at the stop
        if self._keys is not None:
            handshake.exchange(f"{self._keys}end", "", HINT, max(self.timeout, 60.0))
            fate = handshake.store().compare_set(f"{self._keys}fate", "", "end")
            won = fate != b"end"
        if won:
            with self.cond:
                self._pass()
        self._end_thread()
        if self._timer is not None:  # armed only by a signal
            self._timer.cancel()
        late, self.received = self.received, None
        if late is None:
            self._put_back()
        else:
            self._hand_back(late, sys._getframe())

    def _end_thread(self) -> None:
        with self.cond:
            self._over = True
            self.cond.notify_all()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._wake.clear()

    def begin_step(self) -> None:
        """Before a training step: wait or stop here if the stop is reached."""
        with self.cond:
            if self._signaled():
                self._pass()
            self._busy = True

    def end_step(self) -> None:
        with self.cond:
            self.done += 1
            self._busy = False
            self.cond.notify_all()

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around the callback's save: begun only if no process stopped before."""
        with self.cond:
            if self._signaled():
                self._pass(saving=True)
            self._saves += 1
            self._saving = True
        try:
            yield
        finally:
            with self.cond:
                self._saving = False
                self.cond.notify_all()

    def gate(self) -> None:
        """Between steps or after a save: stop if due."""
        if self._signaled():
            with self.cond:
                self._pass()

    def _signaled(self) -> bool:
        return self._signum is not None or self.received is not None

    def _pass(self, saving: bool = False) -> None:
        """(under cond) Wait for the agreed stop; park at it (a save, once
        the saves reach it) and let the thread save and end the process."""
        self._wake.set()
        self.cond.wait_for(lambda: self._stop is not None)
        steps, saves = self._stop
        if (saving or self.done >= steps) and self._saves >= saves:
            self.cond.notify_all()
            while True:
                self.cond.wait()

    def _watch(self) -> None:
        while True:
            self._wake.wait(POLL)
            self._wake.clear()
            with self.cond:
                if self._over:
                    return
            try:
                signum = self._signal()
            except Exception:  # noqa: BLE001 - the group is gone: fit has ended
                return
            if signum is not None:
                break
        self._signum = signum
        self._arm()
        with self.cond:
            mine = (self.done + self._busy, self._saves)
        stop = self._offer(mine)
        with self.cond:
            self._stop = stop
            self.cond.notify_all()
            self.cond.wait_for(
                lambda: (
                    not self._busy
                    and not self._saving
                    and self.done >= stop[0]
                    and self._saves >= stop[1]
                )
            )
            # Holding the lock: the main thread's hooks change nothing now.
            try:
                message = self._save(signum)
            except BaseException as exc:  # noqa: BLE001 - the process ends anyway
                message = (
                    f"keras_dtensor_fix: {signal.Signals(signum).name}: the save "
                    f"at the stop failed ({exc!r}); the newest complete "
                    f"checkpoint is {self.where}"
                )
            leave(128 + signum, message)

    def _signal(self) -> int | None:
        """The signal any process got (this one's offered first), or None."""
        if self._keys is None:
            return self.received
        store, fate = handshake.store(), f"{self._keys}fate"
        if self.received is not None:
            value = store.compare_set(fate, "", str(self.received))
        elif store.check([fate]):
            value = store.get(fate)
        else:
            return None
        if value == b"end":  # fit ended first: no stop
            with self.cond:
                self.cond.wait_for(lambda: self._over)
            sys.exit()  # this thread only
        return int(value)

    def _offer(self, mine: tuple[int, int]) -> tuple[int, int]:
        """Every process's (steps, saves) reach; the largest of each."""
        offers = handshake.exchange(
            f"{self._keys}reach", json.dumps(mine), HINT, self.timeout
        )
        steps, saves = zip(*map(json.loads, offers), strict=True)
        return max(steps), max(saves)

    def _handle(self, signum: int, frame: Any) -> None:
        codes = (f.f_code for f, _ in traceback.walk_stack(frame))
        if self._within is not None and all(c is not self._within for c in codes):
            self._hand_back(signum, frame)
            return
        if self.received is not None:
            return
        self.received = signum
        self._arm()
        self._wake.set()

    def _arm(self) -> None:
        if self._timer is None:  # the deadline, once
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
        """Reinstall the handlers :meth:`start` replaced (None: the default)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
        self._previous.clear()

    def _expire(self) -> None:
        signum = self.received or self._signum or signal.SIGTERM
        leave(
            128 + signum,
            f"keras_dtensor_fix: {signal.Signals(signum).name} received, and no "
            f"step was saved within {self.timeout:g} s (Checkpoint's "
            f"preemption_timeout): exiting; the newest complete checkpoint is "
            f"{self.where}",
        )
