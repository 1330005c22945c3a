"""A ModelParallel ``fit()`` epoch's time per step on a small MLP (64-256-8,
batch 8, 64 steps; Megatron layout, 2 gloo processes): what feeding batches
costs next to a 2.5 ms step. Run it with ``PYTHONPATH`` at two checkouts'
``src``, interleaved:

    PYTHONPATH=SRC OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2 \\
        benchmarks/repro/epoch_loader.py
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch.distributed as dist  # noqa: E402
from keras import layers  # noqa: E402

import keras_dtensor_fix  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(
        (1, dist.get_world_size()), ["batch", "model"], devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense_1/kernel"] = (None, "model")
    layout_map["dense_2/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(3)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(512, 64)).astype("float32")
    y = rng.normal(size=(512, 8)).astype("float32")
    model = keras.Sequential(
        [
            layers.Input((64,)),
            layers.Dense(256, activation="relu", name="dense_1"),
            layers.Dense(8, name="dense_2"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)  # builds, warms up
    per_step = []
    for _ in range(3):
        started = time.perf_counter()
        model.fit(x, y, batch_size=8, epochs=1, verbose=0)
        per_step.append(round(1000 * (time.perf_counter() - started) / 64, 3))
    if dist.get_rank() == 0:
        print("EPOCH", os.path.dirname(keras_dtensor_fix.__file__), per_step)


if __name__ == "__main__":
    main()
