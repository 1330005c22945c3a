"""Optimizer steps on DTensor variables: aligned gradients, local-shard math.

Each torch optimizer's ``_parallel_update_step`` gives a gradient its variable's
placements and, eagerly, updates local shards (:mod:`..ops.shardwise`); compiled, the
original runs on the DTensors.

Gradient accumulation, EMA overwrites and ``LossScaleOptimizer`` branch through
``ops.cond``, whose ``if pred:`` breaks a compiled step's graph where torch 2.13 then
fails on DTensors. Compiled and sharded, those ``cond`` calls run both branches and keep
each variable's with ``torch.where`` (:func:`_selected_cond`)."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from keras_dtensor_fix.dtensor import DTensor
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require
from keras_dtensor_fix.engine.state import compiling
from keras_dtensor_fix.ops import shardwise


def _parallel_update_step(wrapped, instance, args, kwargs):
    grads, variables, learning_rate = _bind(*args, **kwargs)
    if not shardwise.sharded(grads, variables):
        return wrapped(*args, **kwargs)
    return shardwise.update(
        instance, wrapped, grads, variables, learning_rate, local=not compiling()
    )


def _bind(grads, variables, learning_rate):
    return list(grads), list(variables), learning_rate


def _increment_accumulators(wrapped, instance, args, kwargs):
    """Gradient accumulation: add gradients with the accumulators' placements."""
    grads, acc_grads = args[0], args[1]
    values = [v.value for v in acc_grads]
    aligned = shardwise.align_gradients(grads, values)
    return wrapped(aligned, acc_grads, *args[2:], **kwargs)


#: While a compiled, sharded optimizer applies gradients with accumulation or
#: EMA overwrites: the variables its ``cond`` branches may write (the newest
#: last). Empty otherwise, so every other ``cond`` runs as Keras wrote it.
_SELECTING: list[list[Any]] = []


def _apply_gradients(wrapped, instance, args, kwargs):
    """Compiled and sharded, let :func:`_cond` select the step's branches."""
    if not compiling() or not shardwise.selects_branches(instance):
        return wrapped(*args, **kwargs)
    return _selecting(instance, instance, wrapped, args, kwargs)


def _loss_scaled_apply(wrapped, instance, args, kwargs):
    """Compiled and sharded, ``LossScaleOptimizer``'s ``cond`` selects too (over the
    inner optimizer's variables)."""
    if not compiling():
        return wrapped(*args, **kwargs)
    return _selecting(instance, instance.inner_optimizer, wrapped, args, kwargs)


def _selecting(instance: Any, owner: Any, wrapped, args, kwargs) -> Any:
    """``wrapped``, its ``cond`` calls selecting over the variables it may write (the
    trainable, ``owner``'s and ``instance``'s own) when one is a DTensor."""
    trainable = args[1] if len(args) > 1 else kwargs.get("trainable_variables")
    written = [
        *(trainable or instance._trainable_variables),
        *owner._trainable_variables,
        *instance.variables,
    ]
    if not any(isinstance(v.value, DTensor) for v in written):
        return wrapped(*args, **kwargs)
    unique = list({id(v): v for v in written}.values())
    _SELECTING.append(unique)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _SELECTING.pop()


def _selected_cond(
    pred: Any, true_fn: Callable[[], Any], false_fn: Callable[[], Any], variables
) -> Any:
    """``cond`` without a branch: both branches run from the same values, each variable
    keeps the one ``pred`` picks (exact while they write only ``variables``)."""
    values = [v.value for v in variables]
    with torch.no_grad():
        before = [value.clone() for value in values]
        true_out = true_fn()
        after_true = [value.clone() for value in values]
        for value, old in zip(values, before, strict=True):
            value.copy_(old)
        false_out = false_fn()
        for value, new in zip(values, after_true, strict=True):
            value.copy_(torch.where(pred, new, value))
    if true_out is None and false_out is None:
        return None
    return tree_map(lambda t, f: torch.where(pred, t, f), true_out, false_out)


def _cond(wrapped, instance, args, kwargs):
    pred = args[0] if args else kwargs.get("pred")
    if not _SELECTING or not compiling() or not isinstance(pred, torch.Tensor):
        return wrapped(*args, **kwargs)
    return _selected_cond(*args, variables=_SELECTING[-1], **kwargs)


#: Module kind -> the attribute wrapped there and its wrapper (compiled steps run all
#: but the accumulators').
_BY_KIND = {
    "core": ("cond", _cond),
    "base_optimizer": ("BaseOptimizer._backend_apply_gradients", _apply_gradients),
    "loss_scale_optimizer": ("LossScaleOptimizer._common_apply", _loss_scaled_apply),
    "parallel_optimizer": (
        "TorchParallelOptimizer._backend_increment_gradient_accumulators",
        _increment_accumulators,
    ),
}


def patches(module: types.ModuleType) -> list[Patch]:
    name = module.__name__
    for kind, (attribute, wrapper) in _BY_KIND.items():
        if not targets.is_kind(name, kind):
            continue
        if kind == "loss_scale_optimizer":
            require(module, attribute)
        also_in = targets.ALIASES["core_star"] if kind == "core" else ()
        traced = kind != "parallel_optimizer"
        return [Patch(name, attribute, wrapper, also_in, gated=True, traced=traced)]
    update = _parallel_update_step
    result = [
        Patch(name, f"{cls}._parallel_update_step", update, gated=True, traced=True)
        for cls, value in vars(module).items()
        if isinstance(value, type)
        and value.__module__ == name
        and hasattr(value, "_parallel_update_step")
    ]
    if not result:
        raise LookupError(f"no optimizer with _parallel_update_step in {name}")
    return result


IMPLEMENTATION = Implementation(patches)
