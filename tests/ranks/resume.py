"""A job that dies and starts again, for ``test_resume.py``.

Run as ``torch.distributed.run --nproc_per_node=N [--max-restarts=R] resume.py
OUT`` (or plain ``python resume.py OUT`` for the uninterrupted one-process
reference). The script is what a user writes: it starts its process group one
way (``RESUME_INIT``), builds a Megatron MLP on a mesh made from
``list_devices()`` and calls ``fit`` with ``keras_dtensor_fix.checkpoint.
Checkpoint(OUT/ckpt, save_freq=RESUME_SAVE_FREQ)``. Once in ``OUT`` (a
marker file per process), process ``RESUME_KILL_RANK`` (``all``: every
process; ``none``: none) meets ``RESUME_FAULT`` as global batch ``RESUME_AT`` (1-based)
begins:

``kill``     ``os._exit(17)``, inside the step (before its forward pass)
``term``     SIGTERM to itself (``agent``: to torchrun's agent, which forwards it)
``lose``     SIGKILL to its torchrun agent, then ``os._exit(17)``: a node lost
``write``    ``os._exit(17)`` as the next checkpoint write starts (the others write)
``restore``  dies inside the first load of a checkpoint (with ``kill`` first)
``none``     nothing: the uninterrupted run

``RESUME_INIT``: ``keras`` (``keras.distribution.initialize()``), ``torch``
(``init_process_group()``), ``torch_gloo`` (``init_process_group("gloo",
init_method="env://")``), ``torch_keras`` (torch's, then Keras's), ``mesh``
(``init_device_mesh``). ``RESUME_DATA``: ``numpy``, ``shuffle`` (numpy with
``shuffle=True``), ``pydataset``, ``loader`` (a shuffling torch DataLoader).
Each process writes ``OUT/rank<R>.launch<L>.attempt<A>.json``: the batches this attempt
trained, the epochs' logs, final weights and optimizer iterations.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlp  # noqa: E402  (beside this script)

from support import leave  # noqa: E402

OUT = Path(sys.argv[1])
ENV = os.environ.get
ATTEMPT = int(ENV("TORCHELASTIC_RESTART_COUNT", "0"))
LAUNCH = ENV("RESUME_LAUNCH", "0")  # the test's count of torchrun launches
INIT = ENV("RESUME_INIT", "keras")
DATA = ENV("RESUME_DATA", "numpy")
FAULT = ENV("RESUME_FAULT", "none")
AT = int(ENV("RESUME_AT", "13"))
KILL_RANK = ENV("RESUME_KILL_RANK", "1")
SAVE_FREQ = int(ENV("RESUME_SAVE_FREQ", "5"))
BACKGROUND = ENV("RESUME_BACKGROUND", "0") == "1"
EPOCHS, BATCH, SAMPLES = int(ENV("RESUME_EPOCHS", "2")), 8, 128


def start_group() -> None:
    if "RANK" not in os.environ:
        return
    if INIT in ("torch", "torch_keras"):
        dist.init_process_group()
    elif INIT == "torch_gloo":
        dist.init_process_group("gloo", init_method="env://")
    elif INIT == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    if INIT in ("keras", "torch_keras"):
        keras.distribution.initialize()
    mlp.set_distribution()


def once(what: str) -> bool:
    """True the first time this process asks, across attempts and launches."""
    marker = OUT / f"{what}.rank{ENV('RANK', '0')}"
    if marker.exists():
        return False
    marker.touch()
    return True


def mine() -> bool:
    if KILL_RANK in ("all", "none"):
        return KILL_RANK == "all"
    return int(KILL_RANK) == int(ENV("RANK", "0"))


class Fault(keras.callbacks.Callback):
    """Records what this attempt trains; meets the fault on attempt 0."""

    def __init__(self) -> None:
        super().__init__()
        self.trained: list[list[int]] = []
        self.epochs: list[int] = []
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        self.epochs.append(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        self.trained.append([self.epoch, batch])
        dump(self, None)  # what a dying process leaves
        step = self.epoch * (SAMPLES // BATCH) + batch + 1
        if step != AT or not mine() or not once("fault"):
            return
        if FAULT in ("kill", "restore"):
            leave(17)
        elif FAULT == "term":
            os.kill(os.getpid(), signal.SIGTERM)
        elif FAULT == "agent":
            os.kill(os.getppid(), signal.SIGTERM)
        elif FAULT == "lose":  # this machine is gone: its agent and itself
            os.kill(os.getppid(), signal.SIGKILL)
            leave(17)
        elif FAULT == "write":
            import torch.distributed.checkpoint as dcp

            def dying(*args, **kwargs):
                leave(17)  # the others are inside the same save

            dcp.save = dying
            dcp.async_save = dying


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 16)).astype("float32")
    y = rng.normal(size=(SAMPLES, 4)).astype("float32")
    if DATA in ("numpy", "shuffle"):
        return {"x": x, "y": y, "shuffle": DATA == "shuffle"}
    if DATA == "pydataset":

        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return SAMPLES // BATCH

            def __getitem__(self, i):
                return x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]

        return {"x": Batches(), "shuffle": True}
    pairs = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(pairs, batch_size=BATCH, shuffle=True)
    return {"x": loader}


def dump(fault: Fault, result: dict | None) -> None:
    rank = int(ENV("RANK", "0"))
    path = OUT / f"rank{rank}.launch{LAUNCH}.attempt{ATTEMPT}.json"
    path.write_text(
        json.dumps(
            {
                "attempt": ATTEMPT,
                "world": int(ENV("WORLD_SIZE", "1")),
                "trained": fault.trained,
                **(result or {}),
            }
        )
    )


def main() -> None:
    from keras_dtensor_fix.checkpoint import Checkpoint

    start_group()
    model = mlp.model()
    ckpt = OUT / "ckpt" / "LATEST"
    if FAULT == "restore" and ckpt.exists() and mine() and once("restore"):
        import torch.distributed.checkpoint as dcp

        def dying_load(*args, **kwargs):
            leave(17)

        dcp.load = dying_load
    fault = Fault()
    checkpoint = Checkpoint(
        str(OUT / "ckpt"), save_freq=SAVE_FREQ, save_on_background=BACKGROUND
    )
    inputs = data()
    history = model.fit(
        **inputs,
        batch_size=None if DATA in ("pydataset", "loader") else BATCH,
        epochs=EPOCHS,
        verbose=0,
        callbacks=[fault, checkpoint],
    )
    dump(fault, {"epochs": fault.epochs, **mlp.outcome(model, history)})


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    main()
    leave(0)
