"""Optimizer steps on DTensor variables: aligned gradients, local-shard math.

Each torch optimizer's ``_parallel_update_step`` is wrapped. When a variable is
a DTensor, its gradient is first given the variable's placements (a ``Partial``
gradient is reduced, a plain one promoted). In eager mode the update then runs
on the local shards: every torch optimizer is elementwise, so shard-wise math is
exact, and no DTensor ``_foreach_*`` op sees the fresh 0-d tensors that Keras
builds each step (they miss PyTorch's sharding cache and leak into it). Under
torch.compile the original runs on the aligned DTensors, except in blocks
mode's compiled update (``state.SHARDWISE_UPDATE``), which traces the local
math too when no branch is selected. Keras imports a torch
optimizer's module only when one is built: the family's row declares
``preload``, so the engine imports them with Keras.

Gradient accumulation and EMA with ``ema_overwrite_frequency`` branch on the
step count through Keras's ``ops.cond``, whose ``if pred:`` on a tensor breaks
a compiled step's graph; dynamo cannot break under the optimizer's
``name_scope``, so it breaks at ``optimizer.apply`` and compiles the forward and
backward alone, where torch 2.13's check of the outputs against the traced
``autograd.grad`` asserts a FakeTensor and finds a DTensor. Compiled and
sharded, those two ``cond`` calls run both branches and keep each variable's
branch with ``torch.where`` (:func:`_selected_cond`): no break, the same values.
``LossScaleOptimizer``'s ``cond`` on finite gradients (and its nested one on
the growth counter) broke the same way: its ``_common_apply`` selects too.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._pytree import tree_map

from keras_dtensor_fix.dtensor import DTensor, planner, to_placements
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import SHARDWISE_UPDATE, compiling
from keras_dtensor_fix.ops.values import local_tensors


def align_gradients(grads: Sequence[Any], values: Sequence[Any]) -> list[Any]:
    """Give each gradient its variable's placements (or the full value)."""

    aligned = []
    for grad, value in zip(grads, values, strict=False):
        if grad is None:
            aligned.append(grad)
        elif isinstance(value, DTensor):
            aligned.append(to_placements(grad, value))
        elif isinstance(grad, DTensor):
            aligned.append(grad.full_tensor())
        else:
            aligned.append(grad)
    return aligned


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def _shardwise_ok(optimizer: Any, values: Sequence[Any], grads: Sequence[Any]) -> bool:
    """Whether :func:`planner.shardwise` lets the update run on local shards."""

    states = [getattr(variable, "_value", None) for variable in optimizer.variables]
    operands = [*values, *(g for g in grads if g is not None)]
    return planner.shardwise(operands, states) is not None


def _parallel_update_step(wrapped, instance, args, kwargs):
    grads, variables, learning_rate = _bind(*args, **kwargs)
    values = [v._value for v in variables]
    if not any(isinstance(v, DTensor) for v in values) and not any(
        isinstance(g, DTensor) for g in grads
    ):
        return wrapped(*args, **kwargs)
    grads = align_gradients(grads, values)
    # Blocks mode's compiled update traces the shard-wise math too (no DTensor
    # dispatch to trace or run), except where branches are selected: their
    # in-place copies on the swapped values fail AOT's input mutations.
    shardwise = SHARDWISE_UPDATE[-1] if SHARDWISE_UPDATE else None
    traced = compiling() and not (shardwise is True and not _SELECTING)
    if traced or not _shardwise_ok(instance, values, grads):
        return wrapped(grads, variables, learning_rate)
    with local_tensors(list(variables) + list(instance.variables)):
        grads, learning_rate = [_local(g) for g in grads], _local(learning_rate)
        if callable(shardwise) and not compiling():
            # blocks mode's eager apply: the runner compiles it group by group
            return shardwise(wrapped, instance, grads, variables, learning_rate)
        return wrapped(grads, variables, learning_rate)


def _bind(grads, variables, learning_rate):
    return list(grads), list(variables), learning_rate


def _increment_accumulators(wrapped, instance, args, kwargs):
    """Gradient accumulation: add gradients with the accumulators' placements."""
    grads, acc_grads = args[0], args[1]
    values = [v.value for v in acc_grads]
    return wrapped(align_gradients(grads, values), acc_grads, *args[2:], **kwargs)


#: While a compiled, sharded optimizer applies gradients with accumulation or
#: EMA overwrites: the variables its ``cond`` branches may write (the newest
#: last). Empty otherwise, so every other ``cond`` runs as Keras wrote it.
_SELECTING: list[list[Any]] = []


def _branching(optimizer: Any) -> bool:
    return bool(
        optimizer.gradient_accumulation_steps
        or (optimizer.use_ema and optimizer.ema_overwrite_frequency)
    )


def _apply_gradients(wrapped, instance, args, kwargs):
    """Compiled and sharded, let :func:`_cond` select the step's branches."""
    if not compiling() or not _branching(instance):
        return wrapped(*args, **kwargs)
    trainable = list(args[1] if len(args) > 1 else kwargs["trainable_variables"])
    written = [*trainable, *instance._trainable_variables, *instance.variables]
    return _selecting(written, wrapped, args, kwargs)


def _loss_scaled_apply(wrapped, instance, args, kwargs):
    """Compiled and sharded, ``LossScaleOptimizer``'s ``cond`` on finite
    gradients selects its branch: they write the trainable variables, the
    inner optimizer's variables and the scale's (``instance.variables``)."""
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
    """``cond`` without a branch: each branch runs from the same variable
    values, and every variable keeps the value of the branch ``pred`` picks.
    Exact (a selection, not arithmetic) as long as the branches write only
    ``variables``, which is what Keras's optimizer branches do."""
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
