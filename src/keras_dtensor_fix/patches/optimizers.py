"""Optimizer steps on DTensor variables: aligned gradients, local-shard math.

Each torch optimizer's ``_parallel_update_step`` gives a gradient its variable's
placements and, eagerly, updates local shards (:mod:`..ops.shardwise`); compiled, the
original runs on the DTensors.

Gradient accumulation, EMA overwrites and ``LossScaleOptimizer`` branch through
``ops.cond``, whose ``if pred:`` breaks a compiled step's graph where torch 2.13 then
fails on DTensors. Compiled and sharded, those ``cond`` calls run both branches and keep
each variable's with ``torch.where`` (:func:`_selected_cond`): no break, the same
values."""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from keras_dtensor_fix.dtensor import DTensor
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import compiling
from keras_dtensor_fix.ops import shardwise


def _parallel_update_step(wrapped, instance, args, kwargs):
    grads, variables, learning_rate = _bind(*args, **kwargs)
    if not shardwise.sharded(grads, variables):
        return wrapped(*args, **kwargs)
    # Traced (a compiled step), the update runs on the aligned DTensors.
    local = not compiling()
    return shardwise.update(
        instance, wrapped, grads, variables, learning_rate, local=local
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
    trainable = list(args[1] if len(args) > 1 else kwargs["trainable_variables"])
    written = [*trainable, *instance._trainable_variables, *instance.variables]
    return _selecting(written, wrapped, args, kwargs)


def _loss_scaled_apply(wrapped, instance, args, kwargs):
    """Compiled and sharded, ``LossScaleOptimizer``'s ``cond`` selects too: over the
    trainable, the inner optimizer's and the scale's variables."""
    if not compiling():
        return wrapped(*args, **kwargs)
    trainable = args[1] if len(args) > 1 else kwargs.get("trainable_variables")
    inner = instance.inner_optimizer
    written = [
        *(trainable or instance._trainable_variables),
        *inner._trainable_variables,
        *instance.variables,
    ]
    return _selecting(written, wrapped, args, kwargs)


def _selecting(written: list[Any], wrapped, args, kwargs) -> Any:
    """``wrapped``, its ``cond`` calls selecting over ``written`` when one is
    a DTensor (:func:`_cond`)."""
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
    """``cond`` without a branch: both branches run from the same values and each
    variable keeps the one ``pred`` picks (exact while they write only ``variables``).
    """
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
    if not _SELECTING or not compiling():
        return wrapped(*args, **kwargs)
    pred, true_fn, false_fn = _bind_cond(*args, **kwargs)
    if not isinstance(pred, torch.Tensor):
        return wrapped(*args, **kwargs)
    return _selected_cond(pred, true_fn, false_fn, _SELECTING[-1])


def _bind_cond(pred, true_fn, false_fn):
    return pred, true_fn, false_fn


def patches(module: types.ModuleType) -> list[Patch]:
    if targets.is_kind(module.__name__, "core"):
        return [
            Patch(
                module.__name__,
                "cond",
                _cond,
                also_in=targets.aliases("core_star"),
                gated=True,
                traced=True,
            )
        ]
    if targets.is_kind(module.__name__, "base_optimizer"):
        attribute = "BaseOptimizer._backend_apply_gradients"
        return [
            Patch(module.__name__, attribute, _apply_gradients, gated=True, traced=True)
        ]
    if targets.is_kind(module.__name__, "loss_scale_optimizer"):
        attribute = "LossScaleOptimizer._common_apply"
        if "_common_apply" not in vars(getattr(module, "LossScaleOptimizer", object)):
            raise LookupError(f"{attribute} not found: this Keras moved it")
        return [
            Patch(
                module.__name__, attribute, _loss_scaled_apply, gated=True, traced=True
            )
        ]
    if targets.is_kind(module.__name__, "parallel_optimizer"):
        attribute = "TorchParallelOptimizer._backend_increment_gradient_accumulators"
        return [Patch(module.__name__, attribute, _increment_accumulators, gated=True)]
    result = []
    for name, cls in vars(module).items():
        if (
            isinstance(cls, type)
            and cls.__module__ == module.__name__
            and hasattr(cls, "_parallel_update_step")
        ):
            result.append(
                Patch(
                    module.__name__,
                    f"{name}._parallel_update_step",
                    _parallel_update_step,
                    gated=True,
                    traced=True,
                )
            )
    if not result:
        raise LookupError(
            f"no optimizer with _parallel_update_step in {module.__name__}"
        )
    return result


IMPLEMENTATION = Implementation(patches)
