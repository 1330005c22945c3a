"""Preemption: a signal, then every process stops at the same step.

A scheduler sends SIGTERM (SLURM with ``--signal``: another one the user
names) and kills the job after a grace period; torchrun forwards it to every
worker, or only one process may get it. The handler only notes the signal
and starts a deadline. At a step's end every process offers what it has
seen to an all-reduce (MAX) on a gloo group of its own, started without
waiting and read at the next poll: so every process learns of a signal at
the same step, whichever got it. Short steps are polled every few steps
(the processes agree on how many in the same all-reduce), so that watching
costs at most :data:`SHARE` of the time and a signal is seen within about
:data:`LATENCY` seconds. When the deadline passes first (a save that will not end,
a process that does not come), the process exits on its own, naming the
checkpoint it leaves. A signal that arrives once the watched call (``fit``)
has left the stack without ending the watch (it raised: Keras calls no
``on_train_end``) goes to the handler that was there before, put back.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable
from types import CodeType, FrameType
from typing import Any

import torch
import torch.distributed as dist

#: Seconds from the signal to the process's exit, save included: well inside
#: the 30 s torchrun (and most schedulers) wait before SIGKILL.
DEFAULT_TIMEOUT = 20.0
#: At most this share of a step's time goes to watching...
SHARE = 0.002
#: ...and polls are at most this many seconds of steps apart (then a signal
#: stops training within about this long, plus a step).
LATENCY = 1.0


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


class Watcher:
    """Notes ``signals`` during ``fit``; :meth:`poll` agrees on a stop."""

    def __init__(self, signals: Iterable[int], timeout: float) -> None:
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.timeout = timeout
        self.received: int | None = None  # this process's signal
        self.where = "no checkpoint yet"  # what a deadline exit names
        self._previous: dict[int, Any] = {}
        self._group: Any = None
        self._work: Any = None
        self._flag = torch.zeros(2, dtype=torch.int64)  # signal, interval
        self._countdown = 0  # steps until the next poll
        self._last: float | None = None  # when the last poll launched
        self._spent = 0.0  # seconds the polls took on this thread since
        self._timer: threading.Timer | None = None
        self._within: CodeType | None = None

    def start(self, within: CodeType | None = None) -> None:
        """Install the handlers (main thread only) and, if any, the group.

        ``within``: the code of the call being watched (``fit``); a signal
        while no frame of it is on the stack is not this watch's.
        """
        self._within = within
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
        if dist.is_initialized() and self._group is None:
            self._group = dist.new_group(backend="gloo")  # every process, in step

    def stop(self) -> int | None:
        """At ``fit``'s end, every process: put the previous handlers back.

        Returns a signal that arrived after the last step's poll on any
        process (one blocking all-reduce), or None.
        """
        if not self.signals:
            return None
        if self._work is not None:
            self._work.wait()
            self._work = None
        self._put_back()
        if self._group is None:
            return self.received
        self._flag.copy_(torch.tensor([self.received or 0, 1]))
        dist.all_reduce(self._flag, dist.ReduceOp.MAX, group=self._group)
        return int(self._flag[0]) or None

    def _handle(self, signum: int, frame: Any) -> None:
        if self._within is not None and not _on_stack(frame, self._within):
            self._hand_back(signum, frame)
            return
        if self.received is not None:
            return
        self.received = signum
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
        name = signal.Signals(self.received).name
        leave(
            exit_code(self.received),
            f"keras_dtensor_fix: {name} received, and no step was saved within "
            f"{self.timeout:g} s (Checkpoint's preemption_timeout): exiting; "
            f"the newest complete checkpoint is {self.where}",
        )

    def poll(self) -> int | None:
        """At a step's end, every process at once: the signal to stop on, or None.

        Every process must call it at every step. The all-reduce is launched
        every ``interval`` steps, which the processes agree on in the same
        all-reduce: the smallest that keeps a poll under :data:`SHARE` of the
        steps' time, and at most :data:`LATENCY` seconds of steps apart.
        """
        if not self.signals:
            return None
        if self._group is None:
            return self.received
        if self._countdown > 0:
            self._countdown -= 1
            return None
        now = time.perf_counter()
        agreed, interval = None, 1
        if self._work is not None:
            began = time.perf_counter()
            self._work.wait()
            signum, interval = (int(v) for v in self._flag.tolist())
            agreed = signum or None
            self._spent += time.perf_counter() - began
        if agreed is not None:
            self._work = None
            return agreed
        self._countdown = interval - 1
        proposal = self._proposal(now, interval)
        self._flag.copy_(torch.tensor([self.received or 0, proposal]))
        began = time.perf_counter()
        self._work = dist.all_reduce(
            self._flag, dist.ReduceOp.MAX, group=self._group, async_op=True
        )
        self._spent += time.perf_counter() - began
        return None

    def _proposal(self, now: float, steps: int) -> int:
        """Steps between polls that this process would like next."""
        last, self._last = self._last, now
        spent, self._spent = self._spent, 0.0
        if last is None or steps < 1:
            return 1
        step = max((now - last) / steps, 1e-6)
        cost = max(spent, 1e-6)  # this poll's own time on this thread
        wanted = math.ceil(cost / (SHARE * step))
        return max(1, min(wanted, int(LATENCY / step) or 1))


def _on_stack(frame: FrameType | None, code: CodeType) -> bool:
    """Whether a frame running ``code`` is ``frame`` or one of its callers."""
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False
