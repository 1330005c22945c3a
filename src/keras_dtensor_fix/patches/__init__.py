"""Patch families: one module per patched area of Keras's torch backend.

Each family module exposes ``FAMILY``, ``MODULES`` and ``patches(module)``
(see :mod:`keras_dtensor_fix.engine`). Keep their top-level imports cheap
(no torch, keras or numpy): the engine imports them at interpreter start.
"""

FAMILY_MODULES: tuple[str, ...] = (
    "optimizers",
    "numpy_ops",
    "data",
    "promotion",
    "variables",
    "compile",
    "ops",
    "random",
)
