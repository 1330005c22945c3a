"""A ``Checkpoint`` whose directory some process cannot write, for
``test_checkpoint_directory.py``.

Run as ``torch.distributed.run --nproc_per_node=2 unwritable.py OUT_DIR
WHO`` (``all``: no process can write, ``last``: the last one cannot, ``none``:
every process can). The unwritable directory lies under a regular file (root
ignores a directory's mode bits). Each rank writes ``OUT_DIR/rank<R>.json``:
the error it raised (type, message) and the batches trained before it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import keras
import numpy as np

from keras_dtensor_fix.checkpoint import Checkpoint

RANK = int(os.environ.get("RANK", "0"))
WORLD = int(os.environ.get("WORLD_SIZE", "1"))


class Batches(keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def on_train_batch_begin(self, batch, logs=None) -> None:
        self.count += 1


def main(out: Path, who: str) -> int:
    if WORLD > 1:
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh((1, WORLD), ["batch", "model"], devices)
        layout = keras.distribution.LayoutMap(mesh)
        layout[".*hidden/kernel"] = (None, "model")
        dist = keras.distribution.ModelParallel(
            layout_map=layout, batch_dim_name="batch"
        )
        dist.auto_shard_dataset = False  # every process reads every batch
        keras.distribution.set_distribution(dist)
    blocker = out / "a-file"
    blocker.write_text("")
    unwritable = who == "all" or (who == "last" and RANK == WORLD - 1)
    directory = (blocker if unwritable else out) / "checkpoints"
    model = keras.Sequential(
        [
            keras.layers.Input((4,)),
            keras.layers.Dense(8, name="hidden"),
            keras.layers.Dense(2, name="output"),
        ]
    )
    model.compile("sgd", "mse")
    x = np.ones((16, 4), "float32")
    batches = Batches()
    result = {"type": "no error"}
    try:
        model.fit(
            x,
            x[:, :2],
            batch_size=8,
            verbose=0,
            callbacks=[batches, Checkpoint(directory, save_freq=1)],
        )
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        result = {"type": type(exc).__name__, "message": str(exc)}
    result["batches"] = batches.count
    result["directory"] = str(directory)
    result["saved"] = sorted(p.name for p in directory.glob("ckpt-*"))
    (out / f"rank{RANK}.json").write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import leave  # skips a teardown that can abort: see leave()

    leave(main(Path(sys.argv[1]), sys.argv[2]))
