"""In blocks mode, the optimizer's update as one compiled region.

Blocks mode (:mod:`keras_dtensor_fix.compiled.blocks`) runs the training
step eagerly around its compiled blocks, so the optimizer's update ran op by
op: on CPU each ``torch._foreach_*`` of Keras's torch optimizers is one op per
variable, a few hundred small ops a step, which the whole step's graph fuses
into a few kernels. Here the model's optimizer gets an instance ``apply``
that runs the class's own ``apply`` through one ``torch.compile``'d function
per optimizer (static shapes, the process-keyed cache tag, guards skipped once
settled). Inside, the ``optimizers`` family runs the update as it runs it
eagerly: the elementwise math on each variable's local shard
(``state.SHARDWISE_UPDATE`` says so while the region runs), so neither the
trace nor the graph goes through DTensor's dispatch; where Keras's optimizer
branches (gradient accumulation, EMA overwrites, loss scaling), it selects
the branches on the aligned DTensors, as a whole compiled step does.

Where the optimizer's update is per variable
(:func:`keras_dtensor_fix.compiled.update_groups.groupable`), ``apply`` runs
eagerly and only that update is compiled, block by block
(:mod:`keras_dtensor_fix.compiled.update_groups`): one graph serves every
block alike, so the compile does not grow with the depth. The whole-``apply``
region serves the rest (Nadam, loss scaling, branches, optimizers of a
user's own).

Only for a model trained by Keras's own ``train_step`` (a custom step may
call ``apply`` as it likes), a built optimizer, DTensor gradients and a
ModelParallel distribution; anything else runs the original. A compile
failure runs the original from then on (warned); a failure inside the
compiled update at run time is the ``compile`` family's (its step runs again
eagerly only where no optimizer counted a step).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keras_dtensor_fix.compiled import refusals, region, update_groups
from keras_dtensor_fix.dtensor import DTensor
from keras_dtensor_fix.engine import state


@dataclass
class _Region:
    #: The whole ``apply`` compiled (:func:`_update`).
    whole: region.Region
    #: The per-group update, where the optimizer's update is per variable.
    grouped: update_groups.Grouped | None = None


#: Optimizer -> its region, for the optimizers whose ``apply`` is installed.
_REGIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Compiled updates since the import.
_USED = [0]
#: False: the update runs eagerly in blocks mode (benchmarks compare).
ENABLED = True
#: False: the whole ``apply`` is one region even where the update could
#: compile per block (benchmarks compare).
GROUPED = True


def refusal(model: Any) -> str | None:
    """Why ``model``'s optimizer update cannot be a region, or None."""
    if not ENABLED:
        return "turned off"
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not callable(getattr(optimizer, "apply", None)):
        return "it has no optimizer"
    if not refusals.keras_train_step(model):
        return "its class has a train_step() of its own"
    return None


def install(model: Any, routed: list[Any] = ()) -> str | None:
    """Give ``model``'s optimizer a compiled ``apply``; None, or why not.

    With ``routed`` (the blocks compiled) and a per-variable update, the
    update compiles per block instead (the module)."""
    reason = refusal(model)
    if reason is not None:
        return reason
    optimizer = model.optimizer
    if optimizer in _REGIONS:
        return None
    what = f"the update of {type(optimizer).__name__}"
    qualname = f"{type(optimizer).__qualname__}.apply"
    whole = region.Region(_update, what, qualname=qualname)
    found = _REGIONS[optimizer] = _Region(whole)
    if GROUPED and routed and update_groups.groupable(optimizer) is None:
        found.grouped = update_groups.Grouped(optimizer, list(routed))
    original = optimizer.apply

    def apply(grads: Any, trainable_variables: Any = None) -> Any:
        grads = list(grads)
        if (
            whole.failed
            or trainable_variables is None
            or not optimizer.built
            or state.compiling()
            or state.model_parallel() is None
            or not any(isinstance(g, DTensor) for g in grads)
        ):
            return original(grads, trainable_variables)
        variables = list(trainable_variables)
        if found.grouped is not None:
            return _grouped(found.grouped, original, grads, variables)
        state.SHARDWISE_UPDATE.append(True)
        try:
            result = whole(
                lambda: original(grads, variables), optimizer, grads, variables
            )
        finally:
            state.SHARDWISE_UPDATE.pop()
        _USED[0] += not whole.failed
        return result

    state.set_attribute(optimizer, "apply", apply)
    return None


def how(model: Any) -> str:
    """How ``model``'s optimizer update compiles, once installed."""
    optimizer = getattr(model, "optimizer", None)
    found = _REGIONS.get(optimizer) if optimizer is not None else None
    if found is not None and found.grouped is not None:
        return "per block, one graph for the blocks alike"
    return "one region"


def uninstall(model: Any) -> None:
    """Give ``model``'s optimizer its class's ``apply`` back."""
    optimizer = getattr(model, "optimizer", None)
    try:
        installed = optimizer is not None and _REGIONS.pop(optimizer, None)
    except TypeError:  # an object no weak reference can hold: nothing installed
        return
    if installed:
        vars(optimizer).pop("apply", None)


def used() -> int:
    """How many optimizer updates ran compiled since the import."""
    return _USED[0]


def forget() -> None:
    """Drop every region (on deactivation; the attributes are undone by state)."""
    _REGIONS.clear()


def _grouped(
    grouped: update_groups.Grouped, original: Callable[..., Any], grads, variables
) -> Any:
    """The original ``apply``, eagerly, its shard-wise update per group."""
    before = grouped.used
    state.SHARDWISE_UPDATE.append(grouped)
    try:
        result = original(grads, variables)
    finally:
        state.SHARDWISE_UPDATE.pop()
    _USED[0] += grouped.used > before
    return result


def _update(optimizer: Any, grads: list, variables: list) -> Any:
    return type(optimizer).apply(optimizer, grads, variables)
