"""Patch families: one module per patched area of Keras's torch backend.

Each family module exposes ``FAMILY``, ``MODULES`` and ``patches(module)``
(see :mod:`keras_dtensor_fix.engine`). Keep their top-level imports cheap
(no torch, keras or numpy): the engine imports them at interpreter start.
"""

from keras_dtensor_fix.config import FAMILIES

#: Family name -> its module in this package, where the two differ.
MODULE_OF_FAMILY = {"numpy": "numpy_ops"}

FAMILY_MODULES: tuple[str, ...] = tuple(MODULE_OF_FAMILY.get(f, f) for f in FAMILIES)
