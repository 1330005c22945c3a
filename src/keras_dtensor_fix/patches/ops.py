"""The torch backend's nn, math, linalg, image and core ops on DTensors.

Loss functions (``binary_crossentropy(target, output)``), attention,
normalization and segment ops take several tensors too; each multi-tensor
function gets the op-handler table's wrapper (:mod:`keras_dtensor_fix.ops.handlers`),
with the rows for convolutions and attention among them. From the core
module only ``slice_update`` (one tensor written into another) is wrapped: its
other multi-tensor functions are the numpy module's.
"""

from __future__ import annotations

import types

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.ops import handlers

#: The core module's own functions that write one tensor into another.
CORE = ("slice_update",)


def patches(module: types.ModuleType) -> list[Patch]:
    core = targets.is_kind(module.__name__, "core")
    names = CORE if core else handlers.target_names(module)
    return [
        Patch(
            module.__name__,
            name,
            handlers.wrapper_for(name, getattr(module, name), elementwise=False),
            also_in=targets.aliases("core") if core else (),
            gated=True,
        )
        for name in names
        if hasattr(module, name)
    ]


IMPLEMENTATION = Implementation(patches)
