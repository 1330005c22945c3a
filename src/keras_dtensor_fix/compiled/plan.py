"""Blocks mode for one model, built and undone in one place, in order.

:func:`install` routes the repeated blocks through their classes' regions
(:mod:`.blocks`), then, for a training step, the tail and loss (:mod:`.tail`) and the
optimizer's update per block (:mod:`.update_groups`). One :class:`Plan` per model;
:func:`uninstall` undoes it in reverse."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from keras_dtensor_fix.compiled import blocks, region, tail, update_groups
from keras_dtensor_fix.engine import wrappers


@dataclass
class Plan:
    """What blocks mode installed on one model."""

    blocks: list[Any] = field(default_factory=list)
    #: The tail's split, where the tail is one region.
    split: Any = None
    #: Whether the optimizer's update runs per block.
    update: bool = False


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _plan_of(model: Any) -> Plan | None:
    try:
        return _PLANS.get(model)
    except TypeError:  # no weak reference to it (not a Keras model): none installed
        return None


def install(model: Any, training: bool) -> Plan | None:
    """Blocks mode for ``model`` (``training``: its tail and update too); None where it
    repeats no block it can compile alone."""
    routed = blocks.install(model)  # a new step: every block's guards run again
    if not routed:
        uninstall(model)
        return None
    found = _PLANS.setdefault(model, Plan())
    found.blocks = routed
    if training and found.split is None:
        split = tail.install(model, routed)
        found.split = None if isinstance(split, str) else split
    if training and not found.update:
        found.update = update_groups.install(model, routed) is None
    return found


def uninstall(model: Any) -> None:
    """Undo :func:`install` on ``model``, the update first, the blocks last."""
    found = _plan_of(model)
    if found is None:
        return
    del _PLANS[model]
    if found.update:
        update_groups.uninstall(model)
    if found.split is not None:
        tail.uninstall(model, found.split)
    blocks.uninstall(found.blocks)


def step(train_step: Callable[..., Any], model: Any, args: tuple, kwargs: dict) -> Any:
    """Keras's ``train_step``, its batch kept for the model's tail."""
    found = _plan_of(model)
    if found is None or found.split is None:
        return train_step(*args, **kwargs)
    return tail.step(found.split, train_step, args, kwargs)


# A whole step compiles Keras's train_step as its first frame, as upstream
# does: this wrapper, run first, is not a frame of its own.
wrappers.not_a_frame(step.__code__)


def forget() -> None:
    """Drop every plan and compiled region, generation's too (deactivation)."""
    _PLANS.clear()
    region.forget()
