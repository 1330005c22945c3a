"""The user's model shared by ``resume.py`` and ``preempt.py``.

A Megatron MLP (``hidden`` column parallel, ``output`` row parallel) on a
(1, N) mesh made from ``list_devices()``, every process reading every batch.
"""

from __future__ import annotations

import keras
import numpy as np


def set_distribution(shape: tuple[int, int] | None = None) -> None:
    """ModelParallel over every process (a ``shape`` mesh, default (1, N)),
    the MLP's Megatron layout."""
    devices = keras.distribution.list_devices()
    shape = shape or (1, len(devices))
    mesh = keras.distribution.DeviceMesh(shape, ["batch", "model"], devices)
    layout = keras.distribution.LayoutMap(mesh)
    layout[".*hidden/kernel"] = (None, "model")  # column parallel
    layout[".*hidden/bias"] = ("model",)
    layout[".*output/kernel"] = ("model", None)  # row parallel
    distribution = keras.distribution.ModelParallel(
        layout_map=layout, batch_dim_name="batch"
    )
    distribution.auto_shard_dataset = False  # every process reads every batch
    keras.distribution.set_distribution(distribution)


def model() -> keras.Model:
    """The MLP, seeded, compiled with Adam and ``mae``."""
    keras.utils.set_random_seed(7)
    built = keras.Sequential(
        [
            keras.layers.Input((16,)),
            keras.layers.Dense(32, activation="relu", name="hidden"),
            keras.layers.Dropout(0.1, seed=7, name="drop"),
            keras.layers.Dense(4, name="output"),
        ]
    )
    built.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=["mae"])
    return built


def outcome(built: keras.Model, history: keras.callbacks.History) -> dict:
    """What a run is compared by: history, optimizer steps, weights."""
    return {
        "history": history.history,
        "iterations": int(np.asarray(built.optimizer.iterations)),
        "weights": [np.asarray(w, "float64").tolist() for w in built.get_weights()],
    }
