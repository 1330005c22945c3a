"""A job preempted in some phase of ``fit``, for ``test_preemption.py``.

Run as ``torch.distributed.run --nproc_per_node=2 preempt.py OUT`` (or
``python preempt.py OUT``: the uninterrupted one-process reference). The
script is a user's: a Megatron MLP on a mesh from ``list_devices()``, a
``PyDataset`` of 16 batches (unshuffled), validation data of 30 batches, 2
epochs, ``Checkpoint(OUT/ckpt, save_freq=5, preemption_timeout=5)`` (or,
``PREEMPT_UPSTREAM=1``, Keras's ``BackupAndRestore(OUT/backup, save_freq=5)``).
On the first launch (``PREEMPT_LAUNCH=0``) process 0 sends SIGTERM to its
torchrun agent (which forwards it to every process) at ``PREEMPT_CASE``'s
moment, and the job is slow where the case says:

``validation``  as the third validation batch of epoch 1 begins; each
                validation batch takes 0.3 s
``data``        as training batch 10 of epoch 1 is drawn, which takes 8 s
``jump``        as step 13 begins; steps take a few ms, 0.4 s from step 10 on
``callback``    in a callback's ``on_epoch_end`` (epoch 1), which takes 8 s
``save``        as step 11 begins, the background save of step 10 in flight
                (its write takes 1.5 s longer)
``none``        nothing (the reference)

Each process writes ``OUT/rank<R>.launch<L>.json``: the batches it trained,
and at the end the history, weights and optimizer iterations.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlp  # noqa: E402  (beside this script)

from support import leave  # noqa: E402

OUT = Path(sys.argv[1])
ENV = os.environ.get
LAUNCH = ENV("PREEMPT_LAUNCH", "0")
CASE = ENV("PREEMPT_CASE", "none") if LAUNCH == "0" else "none"
UPSTREAM = ENV("PREEMPT_UPSTREAM") == "1"
RANK = int(ENV("RANK", "0"))
BATCH, SAMPLES, VALIDATION = 8, 128, 30


def start_group() -> None:
    if "RANK" not in os.environ:
        return
    keras.distribution.initialize()
    mlp.set_distribution()


def preempt() -> None:
    """SIGTERM to torchrun's agent, from process 0, once; the time noted."""
    if RANK == 0:
        (OUT / "signal.time").write_text(str(time.time()))
        os.kill(os.getppid(), signal.SIGTERM)


class Fault(keras.callbacks.Callback):
    """Records what is trained; slows the job and sends the case's signal."""

    def __init__(self) -> None:
        super().__init__()
        self.trained: list[list[int]] = []
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.trained.append([self.epoch, batch])
        dump(self, None)
        if CASE == "jump" and self.epoch == 0 and batch == 12:
            preempt()
        if CASE == "save" and self.epoch == 0 and batch == 10:
            preempt()

    def on_train_batch_end(self, batch, logs=None):
        if CASE == "jump" and (self.epoch, batch) >= (0, 9):
            time.sleep(0.4)

    def on_test_batch_begin(self, batch, logs=None):
        if CASE == "validation" and self.epoch == 0 and batch == 2:
            preempt()

    def on_test_batch_end(self, batch, logs=None):
        if CASE == "validation":
            time.sleep(0.3)

    def on_epoch_end(self, epoch, logs=None):
        if CASE == "callback" and epoch == 0:
            preempt()
            time.sleep(8)


FAULT = Fault()


def data() -> tuple[keras.utils.PyDataset, tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 16)).astype("float32")
    y = rng.normal(size=(SAMPLES, 4)).astype("float32")
    vx = rng.normal(size=(VALIDATION * BATCH, 16)).astype("float32")
    vy = rng.normal(size=(VALIDATION * BATCH, 4)).astype("float32")

    class Batches(keras.utils.PyDataset):
        def __len__(self):
            return SAMPLES // BATCH

        def __getitem__(self, i):
            if CASE == "data" and FAULT.epoch == 0 and i == 9:
                preempt()
                time.sleep(8)  # a slow read: longer than preemption_timeout
            return x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

    return Batches(), (vx, vy)


def slow_background_saves() -> None:
    """Each background save's write ends 1.5 s after DCP's."""
    import concurrent.futures
    import threading

    import torch.distributed.checkpoint as dcp

    real = dcp.async_save

    def async_save(*args, **kwargs):
        done = real(*args, **kwargs)
        done = getattr(done, "upload_completion", done)
        late = concurrent.futures.Future()

        def finish():
            time.sleep(1.5)
            error = done.exception()
            late.set_exception(error) if error else late.set_result(done.result())

        threading.Thread(target=finish, daemon=True).start()
        return late

    dcp.async_save = async_save


def dump(fault: Fault, result: dict | None) -> None:
    path = OUT / f"rank{RANK}.launch{LAUNCH}.json"
    path.write_text(json.dumps({"trained": fault.trained, **(result or {})}))


def main() -> None:
    from keras_dtensor_fix.checkpoint import Checkpoint

    start_group()
    if CASE == "save":
        slow_background_saves()
    model = mlp.model()
    if UPSTREAM:
        keep = keras.callbacks.BackupAndRestore(str(OUT / "backup"), save_freq=5)
    else:
        keep = Checkpoint(
            str(OUT / "ckpt"),
            save_freq=5,
            preemption_timeout=5,
            save_on_background=CASE == "save",
        )
    train, validation = data()
    history = model.fit(
        train,
        validation_data=validation,
        validation_batch_size=BATCH,
        shuffle=False,
        epochs=2,
        verbose=0,
        callbacks=[FAULT, keep],
    )
    dump(FAULT, mlp.outcome(model, history))


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    main()
    leave(0)
