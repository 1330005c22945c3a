"""A ModelParallel script on a Keras build without torch distribution warns.

Stable ``keras`` installed over keras-nightly has no ModelParallel on torch
(Keras fails with ``'NoneType' object has no attribute 'initialize'``). The
first call to ``initialize``, ``list_devices`` or ``set_distribution`` warns
once with the commands that fix the install. Ungated: the gate is closed on
exactly such a build.
"""

from __future__ import annotations

import types
import warnings

from keras_dtensor_fix.engine import install, targets
from keras_dtensor_fix.engine.contract import Implementation, Patch

#: Functions a ModelParallel script calls before anything else distributed.
ENTRY_POINTS: tuple[str, ...] = ("initialize", "list_devices", "set_distribution")

_checked = False


def _entry(wrapped, instance, args, kwargs):
    global _checked
    if not _checked:
        _checked = True
        problem = install.keras_problem() if targets.backend() == "torch" else None
        if problem:
            warnings.warn(f"keras-dtensor-fix: {problem}", stacklevel=2)
    return wrapped(*args, **kwargs)


def patches(module: types.ModuleType) -> list[Patch]:
    if targets.backend() not in (None, "torch"):
        return []  # another backend's ModelParallel is not ours to judge
    name = module.__name__
    also = targets.ALIASES["distribution_api"]
    return [
        Patch(name, function, _entry, also_in=also)
        for function in ENTRY_POINTS
        if callable(getattr(module, function, None))
    ]


def after_revert() -> None:
    global _checked
    _checked = False


IMPLEMENTATION = Implementation(patches, after_revert=after_revert)
