"""The torch backend's numpy ops on DTensors and plain tensors.

Targets: every public function of the numpy module that can take two or more
tensors; what happens to DTensor operands is :mod:`keras_dtensor_fix.ops.handlers`'.
"""

from __future__ import annotations

import types

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.ops import handlers


def patches(module: types.ModuleType) -> list[Patch]:
    return [
        Patch(
            module.__name__,
            name,
            handlers.wrapper_for(name, getattr(module, name)),
            also_in=targets.aliases("numpy"),
            gated=True,
        )
        for name in handlers.target_names(module)
    ]


IMPLEMENTATION = Implementation(patches)
