"""``fit`` resumed inside an epoch skips the batches a checkpoint already holds.

The ``Checkpoint`` callback's plan (:mod:`keras_dtensor_fix.checkpoint.position`)
reaches the epoch iterator here: the adapter's epoch counter is set back (the
same shuffle) and the first batches are drawn and dropped, keeping Keras's
step numbers. Without a plan the generator is Keras's own.
"""

from __future__ import annotations

import types

from keras_dtensor_fix.checkpoint import position
from keras_dtensor_fix.engine.contract import Implementation, Patch, require


def _skipping(batches, skip: int):
    batches = iter(batches)
    for begin, end, iterator in batches:
        if begin >= skip:
            position.skipped()
            yield begin, end, iterator
            yield from batches
            return
        try:
            for _ in range(end - begin + 1):
                next(iterator)  # drawn, not trained
        except StopIteration:
            break
    position.skipped()


def _enumerate(wrapped, instance, args, kwargs):
    skip = position.entering(instance)
    batches = wrapped(*args, **kwargs)
    if not skip:
        return batches
    if instance.steps_per_epoch:
        from keras_dtensor_fix.checkpoint.files import CheckpointError

        raise CheckpointError(
            f"cannot resume inside an epoch (batch {skip}) when fit() is given "
            "steps_per_epoch: its iterator runs across epochs. Save with "
            "save_freq='epoch', or leave steps_per_epoch out"
        )
    return _skipping(batches, skip)


def patches(module: types.ModuleType) -> list[Patch]:
    attribute = require(module, "EpochIterator._enumerate_iterator")
    return [Patch(module.__name__, attribute, _enumerate)]


IMPLEMENTATION = Implementation(patches)
