"""Saving a sharded model on some processes only: an error, not a hang.

``model.save`` and ``save_weights`` gather every sharded variable with a
collective, so every process must call them. Under a sharded distribution the
plugin first checks that all processes arrive (:mod:`keras_dtensor_fix.handshake`).
"""

from __future__ import annotations

import types

from keras_dtensor_fix import targets
from keras_dtensor_fix.engine import Implementation, Patch
from keras_dtensor_fix.handshake import all_processes_call
from keras_dtensor_fix.state import model_parallel

ENTRIES = ("save_model", "save_weights")

HINT = (
    "Under ModelParallel Keras gathers each sharded variable with a collective "
    "while saving, so every process must call it: call it on every process "
    "(with a path of its own, or write only on process 0 by saving there to "
    "the real path and elsewhere to a temporary one), or save the shards "
    "with keras_dtensor_fix.checkpoint.save(model, directory) on every process."
)


def make_wrapper(name: str):
    def wrapper(wrapped, instance, args, kwargs):
        if model_parallel() is not None:
            all_processes_call(f"keras.saving.{name}()", HINT)
        return wrapped(*args, **kwargs)

    return wrapper


def patches(module: types.ModuleType) -> list[Patch]:
    return [
        Patch(
            module.__name__,
            name,
            make_wrapper(name),
            also_in=targets.aliases("saving"),
            gated=True,
        )
        for name in ENTRIES
        if hasattr(module, name)
    ]


IMPLEMENTATION = Implementation(patches)
