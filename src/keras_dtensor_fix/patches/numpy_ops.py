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
    name, also_in = module.__name__, targets.ALIASES["numpy"]
    return [
        Patch(name, op, handlers.wrapper_for(op, getattr(module, op)), also_in, True)
        for op in handlers.target_names(module)
    ]


IMPLEMENTATION = Implementation(patches)
