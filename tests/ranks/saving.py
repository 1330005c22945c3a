"""Keras's own saving, one path on every process, for ``test_saving.py``.

Run as ``torch.distributed.run --nproc_per_node=N saving.py MODE OUT_DIR
[OPTIMIZER]`` (or plain ``python`` for the one-process reference). Every
process passes the SAME paths, as a script written for one device does.

``entries``: fit 2 epochs with ModelCheckpoint (every epoch, ``save_freq=3``,
``save_best_only``, a ``.keras`` model), and BackupAndRestore (epoch and
``save_freq=2``); then ``save_weights`` (plain and ``max_shard_size``) and
``model.save``; every process loads each file back and compares it with its
model. ``resume``: fit 4 epochs with BackupAndRestore; on the first attempt
(``TORCHELASTIC_RESTART_COUNT`` 0) process ``KILL_RANK`` dies at ``KILL_AT``
(``batch`` mid-epoch 3, or ``write``: inside the backup's write in epoch 3);
torchrun restarts the group and fit resumes from the backup
(``RESUME_WITH=checkpoint``: ``keras_dtensor_fix.checkpoint.Checkpoint``'s). Each
process writes ``OUT_DIR/MODE.rank<R>.json``: final weights, losses and checks.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mlp  # noqa: E402  (beside this script)

from support import leave  # noqa: E402

MODE, OUT = sys.argv[1], Path(sys.argv[2])
OPTIMIZER = sys.argv[3] if len(sys.argv) > 3 else "adam"
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
KILL_RANK = int(os.environ.get("KILL_RANK", "1"))
KILL_AT = os.environ.get("KILL_AT", "batch")
MESH = tuple(int(n) for n in os.environ.get("SAVING_MESH", f"1,{WORLD}").split(","))


def distribute() -> None:
    if WORLD == 1:
        return
    keras.distribution.initialize()
    devices = keras.distribution.list_devices()
    if os.environ.get("SAVING_DISTRIBUTION") == "data":
        data_parallel = keras.distribution.DataParallel(devices=devices)
        data_parallel.auto_shard_dataset = False
        keras.distribution.set_distribution(data_parallel)
        return
    mlp.set_distribution(MESH)


def build() -> keras.Model:
    keras.utils.set_random_seed(7)
    model = keras.Sequential(
        [
            keras.layers.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dense(4, name="output"),
        ]
    )
    optimizer = {
        "adam": lambda: keras.optimizers.Adam(1e-2),
        "sgd": lambda: keras.optimizers.SGD(1e-2, momentum=0.9),
    }[OPTIMIZER]()
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    return model


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 16)).astype("float32")
    return x, rng.normal(size=(64, 4)).astype("float32")


def full(model) -> list:
    return [np.asarray(w, dtype="float64").tolist() for w in model.get_weights()]


def same(a, b) -> bool:
    return all(
        np.allclose(x, y, rtol=1e-6, atol=1e-7) for x, y in zip(a, b, strict=True)
    )


def entries() -> dict:
    model = build()
    x, y = data()
    callbacks = [
        keras.callbacks.ModelCheckpoint(
            str(OUT / "every.weights.h5"), save_weights_only=True
        ),
        keras.callbacks.ModelCheckpoint(
            str(OUT / "freq.weights.h5"), save_weights_only=True, save_freq=3
        ),
        keras.callbacks.ModelCheckpoint(
            str(OUT / "best.weights.h5"),
            save_weights_only=True,
            save_best_only=True,
            monitor="loss",
        ),
        keras.callbacks.ModelCheckpoint(str(OUT / "epoch.keras")),
        keras.callbacks.BackupAndRestore(str(OUT / "backup"), delete_checkpoint=False),
        keras.callbacks.BackupAndRestore(str(OUT / "backup_steps"), save_freq=2),
    ]
    history = model.fit(
        x, y, batch_size=16, epochs=2, shuffle=False, verbose=0, callbacks=callbacks
    )
    model.save_weights(str(OUT / "final.weights.h5"))
    model.save_weights(str(OUT / "sharded.weights.json"), max_shard_size=0.000002)
    model.save(str(OUT / "final.keras"))
    weights = model.get_weights()
    checks = {}
    for name in ("final.weights.h5", "sharded.weights.json", "every.weights.h5"):
        fresh = build()
        fresh.load_weights(str(OUT / name))
        checks[name] = same(fresh.get_weights(), weights)
    loaded = keras.saving.load_model(str(OUT / "final.keras"))
    checks["final.keras"] = same(loaded.get_weights(), weights)
    checks["final.keras predict"] = bool(
        np.allclose(
            loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
        )
    )
    model.load_weights(str(OUT / "best.weights.h5"))  # the last epoch's loss is lowest
    checks["best.weights.h5"] = same(model.get_weights(), weights)
    return {"losses": history.history["loss"], "weights": full(model), "checks": checks}


class Kill(keras.callbacks.Callback):
    """Dies mid-epoch 3 on the first attempt (after the epoch-2 backup)."""

    def on_train_batch_end(self, batch, logs=None):
        if ATTEMPT == 0 and RANK == KILL_RANK and self._epoch == 2 and batch == 1:
            print(f"rank {RANK}: killed at epoch 3, batch 2", flush=True)
            os._exit(1)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch


def kill_in_write() -> None:
    """Die inside the epoch-3 backup's write: the staged file half made."""
    from keras.src.saving import saving_lib

    close = saving_lib.H5IOStore.close
    count = {"n": 0}

    def dying_close(self):
        count["n"] += 1
        if count["n"] == 3:  # the third backup: end of epoch 3
            print(f"rank {RANK}: killed while writing a backup", flush=True)
            os._exit(1)
        return close(self)

    saving_lib.H5IOStore.close = dying_close


def resume() -> dict:
    model = build()
    x, y = data()
    if os.environ.get("RESUME_WITH") == "checkpoint":  # the project's own
        from keras_dtensor_fix.checkpoint import Checkpoint

        callbacks = [Checkpoint(str(OUT / "backup"))]
    else:
        callbacks = [keras.callbacks.BackupAndRestore(str(OUT / "backup"))]
    if KILL_AT == "batch":
        callbacks.append(Kill())
    elif ATTEMPT == 0 and RANK == KILL_RANK:
        kill_in_write()
    history = model.fit(
        x, y, batch_size=16, epochs=4, shuffle=False, verbose=0, callbacks=callbacks
    )
    return {
        "losses": history.history["loss"],
        "weights": full(model),
        "attempt": ATTEMPT,
        "backup_left": (OUT / "backup").exists(),
    }


def errors() -> dict:
    """A directory one process cannot write; a full disk on the writer."""
    import errno
    import time

    from keras.src.saving import saving_lib

    model = build()
    x, y = data()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    result = {}
    (OUT / "fine").mkdir(exist_ok=True)
    (OUT / "blocked").write_text("a file where process 1's directory should be")
    path = OUT / ("blocked" if RANK == 1 else "fine") / "w.weights.h5"
    start = time.monotonic()
    try:
        model.save_weights(str(path))
        result["blocked"] = "saved"
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        result["blocked"] = f"{type(exc).__name__}: {exc}"
    result["blocked_seconds"] = time.monotonic() - start
    result["fine_written"] = (OUT / "fine" / "w.weights.h5").is_file()

    shared = str(OUT / "disk.weights.h5")
    model.save_weights(shared)
    good = model.get_weights()
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    close = saving_lib.H5IOStore.close

    def full_disk(self):
        close(self)
        raise OSError(errno.ENOSPC, "No space left on device (simulated)")

    if RANK == 0:
        saving_lib.H5IOStore.close = full_disk
    try:
        model.save_weights(shared)
        result["disk"] = "saved"
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        result["disk"] = f"{type(exc).__name__}: {exc}"
    saving_lib.H5IOStore.close = close
    fresh = build()
    fresh.load_weights(shared)
    result["disk_kept"] = same(fresh.get_weights(), good)
    return result


def main() -> None:
    distribute()
    result = {"entries": entries, "resume": resume, "errors": errors}[MODE]()
    result["files"] = sorted(
        p.name for p in OUT.iterdir() if not p.name.startswith(f"{MODE}.rank")
    )
    (OUT / f"{MODE}.rank{RANK}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
    if WORLD > 1:
        import torch.distributed as dist

        dist.barrier()
    leave(0)
