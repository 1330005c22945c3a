"""Processes that feed uneven data under ModelParallel, for ``test_uneven_data.py``.

Run as ``torch.distributed.run --nproc_per_node=N uneven.py OUT_DIR CASE...``.
A case is ``NAME@MESH`` (``fewer_batches@2,1``): it sets a ModelParallel
distribution on that mesh (none on one process), trains a Megatron MLP on
this process's data and records the outcome: the error's type and message,
or the losses. The cases run one after another in the same processes: a case
that raised did so at the same point on every process, so the next starts
together. Each rank writes ``OUT_DIR/rank<R>.json``. A watchdog ends a
process still running after ``UNEVEN_WATCHDOG`` seconds (default 240), its
threads' stacks dumped: a hang fails the test instead of holding CI.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import time
from pathlib import Path

import keras
import numpy as np
import torch

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))
BATCH = 8


def distribute(mesh: tuple[int, int]) -> None:
    if WORLD == 1:
        keras.distribution.set_distribution(None)
        return
    devices = keras.distribution.list_devices()
    device_mesh = keras.distribution.DeviceMesh(mesh, ["batch", "model"], devices)
    layout = keras.distribution.LayoutMap(device_mesh)
    layout[".*hidden/kernel"] = (None, "model")
    layout[".*output/kernel"] = ("model", None)
    dist = keras.distribution.ModelParallel(layout_map=layout, batch_dim_name="batch")
    dist.auto_shard_dataset = False
    keras.distribution.set_distribution(dist)


def model(jit_compile: bool = False) -> keras.Model:
    """The MLP, compiled by ``aot_eager`` where ``jit_compile`` (the step's
    path is the point here, not inductor's code)."""
    keras.utils.set_random_seed(0)
    net = keras.Sequential(
        [
            keras.layers.Input((6,)),
            keras.layers.Dense(8, activation="relu", name="hidden"),
            keras.layers.Dense(2, name="output"),
        ]
    )
    net.compile(keras.optimizers.SGD(0.1), "mse", jit_compile=jit_compile)
    return net


def data(rows: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 6)).astype("float32")
    return x, x[:, :2] * 0.5


def mine(array: np.ndarray, batch_ranks: int) -> np.ndarray:
    """This process's rows of each batch when ``batch_ranks`` split the batch."""
    if WORLD == 1 or batch_ranks == 1:
        return array
    per = BATCH // batch_ranks
    index = RANK // (WORLD // batch_ranks)
    return array.reshape(-1, batch_ranks, per, *array.shape[1:])[:, index].reshape(
        -1, *array.shape[1:]
    )


def rows(first: int, others: int) -> int:
    return first if RANK == 0 else others


def generator(x: np.ndarray, y: np.ndarray, size: int):
    def batches():
        for start in range(0, len(x), size):
            yield x[start : start + size], y[start : start + size]

    return batches()


# ------------------------------------------------------------------- cases
# Uneven: each returns what fit/evaluate/predict returned (it should raise).


def fewer_batches(jit: bool = False):
    x, y = data(rows(80, 48))
    return model(jit).fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history


def fewer_batches_compiled():
    return fewer_batches(jit=True)


def short_last_batch():
    x, y = data(rows(80, 78))
    return model().fit(x, y, batch_size=BATCH, epochs=1, verbose=0).history


def other_batch_size():
    x, y = data(80)
    size = rows(BATCH, BATCH // 2)
    return model().fit(x, y, batch_size=size, epochs=1, verbose=0).history


def generator_fewer_batches(jit: bool = False):
    x, y = data(rows(80, 48))
    return model(jit).fit(generator(x, y, BATCH), epochs=1, verbose=0).history


def generator_fewer_batches_compiled():
    return generator_fewer_batches(jit=True)


def uneven_validation():
    x, y = data(32)
    vx, vy = data(rows(32, 16))
    net = model()
    return net.fit(x, y, batch_size=BATCH, validation_data=(vx, vy), verbose=0).history


def uneven_predict():
    x, _ = data(rows(32, 24))
    return model().predict(x, batch_size=BATCH, verbose=0).tolist()


def steps_per_epoch_second_epoch():
    """Counts differ under steps_per_epoch: the first epoch runs (upstream's
    too), the second ends early on one process."""
    x, y = data(rows(80, 48))
    return (
        model()
        .fit(x, y, batch_size=BATCH, epochs=2, steps_per_epoch=5, verbose=0)
        .history
    )


# Even: the same batches on every process (each its share of the batch).


def _even(mesh: tuple[int, int], feed: str, jit: bool = False):
    batch_ranks = mesh[0]
    x, y = data(48)
    x, y = mine(x, batch_ranks), mine(y, batch_ranks)
    size = BATCH // batch_ranks if WORLD > 1 else BATCH
    net = model(jit)
    if feed == "generator":
        history = net.fit(generator(x, y, size), epochs=2, verbose=0).history
    elif feed == "steps":
        history = net.fit(
            x, y, batch_size=size, epochs=2, steps_per_epoch=3, shuffle=False, verbose=0
        ).history
    else:
        history = net.fit(
            x,
            y,
            batch_size=size,
            epochs=2,
            validation_data=(x, y),
            shuffle=False,
            verbose=0,
        ).history
    return {key: [float(v) for v in values] for key, values in history.items()}


def even_arrays():
    return _even(MESH, "arrays")


def even_generator():
    return _even(MESH, "generator")


def even_generator_compiled():
    return _even(MESH, "generator", jit=True)


def even_steps_per_epoch():
    return _even(MESH, "steps")


MESH = (2, 1)


def outcome(fn) -> dict:
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "seconds": time.perf_counter() - start,
        }
    return {"type": "no error", "result": result}


def main(out: Path, cases: list[str]) -> int:
    global MESH
    faulthandler.dump_traceback_later(
        float(os.environ.get("UNEVEN_WATCHDOG", "240")), exit=True
    )
    original = torch.compile
    torch.compile = lambda *a, **k: original(*a, **{"backend": "aot_eager", **k})
    results = {}
    for case in cases:
        name, _, mesh = case.partition("@")
        MESH = tuple(int(n) for n in mesh.split(","))
        distribute(MESH)
        results[case] = outcome(globals()[name])
    (out / f"rank{RANK}.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import leave  # skips a teardown that can abort: see leave()

    leave(main(Path(sys.argv[1]), sys.argv[2:]))
