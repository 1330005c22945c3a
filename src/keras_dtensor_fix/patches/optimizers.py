"""Optimizer steps on DTensor variables: aligned gradients, local-shard math.

Each torch optimizer's ``_parallel_update_step`` is wrapped. When a variable is
a DTensor, its gradient is first given the variable's placements (a ``Partial``
gradient is reduced, a plain one promoted). In eager mode the update then runs
on the local shards: every torch optimizer is elementwise, so shard-wise math is
exact, and no DTensor ``_foreach_*`` op sees the fresh 0-d tensors that Keras
builds each step (they miss PyTorch's sharding cache and leak into it). Under
torch.compile the original runs on the aligned DTensors. Keras imports a torch
optimizer's module only when one is built: the family's row declares
``preload``, so the engine imports them with Keras.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

from keras_dtensor_fix.dtensor import DTensor, planner, to_placements
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import compiling
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
    if compiling() or not _shardwise_ok(instance, values, grads):
        return wrapped(grads, variables, learning_rate)
    with local_tensors(list(variables) + list(instance.variables)):
        return wrapped([_local(g) for g in grads], variables, _local(learning_rate))


def _bind(grads, variables, learning_rate):
    return list(grads), list(variables), learning_rate


def _increment_accumulators(wrapped, instance, args, kwargs):
    """Gradient accumulation: add gradients with the accumulators' placements."""
    grads, acc_grads = args[0], args[1]
    values = [v.value for v in acc_grads]
    return wrapped(align_gradients(grads, values), acc_grads, *args[2:], **kwargs)


def patches(module: types.ModuleType) -> list[Patch]:
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
