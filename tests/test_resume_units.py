"""Resuming at the step and preemption, the parts that need one process only.

The jobs that die and resume (2 processes, torchrun) are in
``tests/multiprocess/test_resume.py``.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from support import SRC, clean_env


def test_random_states_come_back() -> None:
    import torch

    from keras_dtensor_fix.checkpoint import position

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    saved = position.random_state()
    draws = random.random(), np.random.rand(), torch.rand(1).item()
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    position.restore_random(saved)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == draws


class _Adapter:
    _epoch = 5


class _Iterator:
    data_adapter = _Adapter()
    steps_per_epoch = None


def test_plan_reaches_the_next_epoch_iterator_once() -> None:
    from keras_dtensor_fix.checkpoint import position

    iterator = _Iterator()
    position.capture()
    position.plan(7, 2)
    assert not position.consumed()
    assert position.entering(iterator) == 7
    assert position.consumed() and iterator.data_adapter._epoch == 2
    assert position.adapter_epoch(at_epoch_begin=True) == 2  # recorded after
    iterator.data_adapter._epoch = 3
    assert position.adapter_epoch(at_epoch_begin=False) == 3
    assert position.entering(iterator) == 0  # the plan was for one epoch
    position.plan(0, 3)  # an epoch's start: nothing to skip, nothing owed
    assert position.consumed()
    assert position.entering(iterator) == 0 and iterator.data_adapter._epoch == 3


def test_skipped_batches_are_drawn_not_yielded() -> None:
    from keras_dtensor_fix.patches.resume import _skipping

    data = iter(range(100))
    batches = ((step, step + 1, data) for step in range(0, 10, 2))  # 2 a step
    kept = [
        (begin, end, next(it), next(it)) for begin, end, it in _skipping(batches, 4)
    ]
    assert kept == [(4, 5, 4, 5), (6, 7, 6, 7), (8, 9, 8, 9)]


def test_steps_per_epoch_refuses_a_resume_inside_an_epoch() -> None:
    from keras_dtensor_fix.checkpoint import position
    from keras_dtensor_fix.checkpoint.files import CheckpointError
    from keras_dtensor_fix.patches.resume import _enumerate

    iterator = _Iterator()
    iterator.steps_per_epoch = 4
    position.plan(2, None)
    with pytest.raises(CheckpointError, match="steps_per_epoch"):
        _enumerate(lambda: iter(()), iterator, (), {})


class Left:
    """Stands in for ``preemption.leave`` (which ends the process)."""

    def __init__(self) -> None:
        import threading

        self.calls: list[tuple[int, str]] = []
        self.done = threading.Event()

    def __call__(self, code: int, message: str) -> None:
        self.calls.append((code, message))
        self.done.set()


def test_a_signal_in_a_step_stops_after_it(monkeypatch) -> None:
    """One process: the thread waits for the step in flight, then saves it
    (the main thread is not needed for the save) and leaves."""
    from keras_dtensor_fix.checkpoint import preemption

    left = Left()
    monkeypatch.setattr(preemption, "leave", left)
    before = signal.getsignal(signal.SIGUSR1)
    watcher = preemption.Watcher([signal.SIGUSR1], timeout=60)
    saved = []
    watcher.done = 3  # steps finished before (a resume)
    watcher.start(lambda signum: saved.append(watcher.done) or "saved")
    watcher.begin_step()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert not left.done.wait(0.5)  # the step is still running
    watcher.end_step()
    assert left.done.wait(10)
    assert saved == [4] and left.calls == [(128 + signal.SIGUSR1, "saved")]
    watcher._timer.cancel()  # the deadline: tested in a process of its own
    watcher._put_back()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_a_signal_between_steps_saves_at_once(monkeypatch) -> None:
    """Nothing running (validation, a data wait): saved without the main thread."""
    from keras_dtensor_fix.checkpoint import preemption

    left = Left()
    monkeypatch.setattr(preemption, "leave", left)
    watcher = preemption.Watcher([signal.SIGUSR1], timeout=60)
    watcher.done = 2
    watcher.start(lambda signum: f"stopped after {watcher.done}")
    watcher.begin_step()
    watcher.end_step()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert left.done.wait(10)
    assert left.calls == [(128 + signal.SIGUSR1, "stopped after 3")]
    assert watcher._stop == (3, 0)
    watcher._timer.cancel()
    watcher._put_back()


def test_watching_costs_microseconds_a_step() -> None:
    """The main thread's part of watching: a lock and a few flags a step
    (about 3 us here; a step of a few ms is what it must stay under 1% of)."""
    import time

    from keras_dtensor_fix.checkpoint.preemption import Watcher

    watcher = Watcher([signal.SIGUSR1], timeout=60)
    watcher.start(lambda signum: "never")
    try:
        began, steps = time.perf_counter(), 20000
        for _ in range(steps):
            watcher.begin_step()
            watcher.end_step()
            watcher.gate()
        each = (time.perf_counter() - began) / steps
    finally:
        watcher.stop()
    assert each < 30e-6, f"{each * 1e6:.1f} us a step"


def test_no_signals_watches_nothing() -> None:
    from keras_dtensor_fix.checkpoint.preemption import Watcher

    before = signal.getsignal(signal.SIGTERM)
    watcher = Watcher((), timeout=1)
    watcher.start(lambda signum: "never")
    assert signal.getsignal(signal.SIGTERM) is before and not watcher.watching()
    watcher.begin_step()
    watcher.end_step()
    watcher.gate()
    watcher.stop()


def test_the_end_puts_the_handlers_back() -> None:
    from keras_dtensor_fix.checkpoint.preemption import Watcher

    before = signal.getsignal(signal.SIGUSR1)
    watcher = Watcher([signal.SIGUSR1], timeout=60)
    watcher.start(lambda signum: "never")
    assert watcher.watching()
    watcher.begin_step()
    watcher.end_step()
    watcher.stop()
    assert not watcher.watching() and signal.getsignal(signal.SIGUSR1) is before


DEADLINE = """
import os, signal, time
from keras_dtensor_fix.checkpoint.preemption import Watcher
watcher = Watcher([signal.SIGTERM], timeout=0.5)
watcher.start(lambda signum: time.sleep(30))  # a save that never ends
watcher.where = "/somewhere/ckpt-000004"
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(30)
"""


def test_a_save_that_never_ends_meets_the_deadline() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(DEADLINE)],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "no step was saved within 0.5 s" in proc.stderr
    assert "/somewhere/ckpt-000004" in proc.stderr


def test_bad_arguments_are_named() -> None:
    from keras_dtensor_fix.checkpoint import Checkpoint

    with pytest.raises(ValueError, match="preemption_timeout"):
        Checkpoint("/tmp/x", preemption_timeout=0)
    with pytest.raises(ValueError, match="save_freq"):
        Checkpoint("/tmp/x", save_freq=0)


def test_checkpoint_package_loads_lazily() -> None:
    """The resume family imports ``position``: no DCP, no Keras with it."""
    code = (
        "import sys; import keras_dtensor_fix.checkpoint.position; "
        "print(any(m.startswith(('keras', 'torch.distributed.checkpoint')) "
        "for m in sys.modules if m != 'keras_dtensor_fix' "
        "and not m.startswith('keras_dtensor_fix')))"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        env=clean_env({"PYTHONPATH": str(SRC)}),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "False", out.stderr


def test_a_signal_after_a_failed_fit_goes_to_the_previous_handler(
    monkeypatch,
) -> None:
    """fit() that raised never calls on_train_end, so the watch is not ended:
    a later signal must not be noted for a step that will never come (the
    process would exit only at the deadline): the handler that was there
    before gets it, and is put back."""
    from keras_dtensor_fix.checkpoint import preemption

    monkeypatch.setattr(preemption, "leave", Left())
    seen = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: seen.append(signum))
    watcher = preemption.Watcher([signal.SIGUSR1], timeout=3600)
    try:

        def fit() -> None:
            watcher.start(lambda signum: "saved", within=fit.__code__)
            os.kill(os.getpid(), signal.SIGUSR1)  # inside fit: the watch's
            raise RuntimeError("a failed epoch")

        with pytest.raises(RuntimeError):
            fit()
        assert watcher.received == signal.SIGUSR1 and not seen
        watcher._timer.cancel()
        watcher.received = None
        os.kill(os.getpid(), signal.SIGUSR1)  # fit has gone
        assert seen == [signal.SIGUSR1] and watcher.received is None
        assert signal.getsignal(signal.SIGUSR1) is not watcher._handle
    finally:
        signal.signal(signal.SIGUSR1, before)


def test_the_watch_knows_fit_from_the_callback(mesh1) -> None:
    import keras
    import numpy as np

    from keras_dtensor_fix.checkpoint.callback import _fit_code

    found = []

    class Look(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            found.append(_fit_code(self.model))

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(loss="mse")
    model.fit(np.zeros((2, 2)), np.zeros((2, 1)), verbose=0, callbacks=[Look()])
    assert found[0] is not None and found[0].co_name == "fit"
    assert _fit_code(model) is None  # outside fit
