"""An optimizer's update on DTensor variables: aligned gradients, local-shard math.

Each gradient gets its variable's placements; the update then runs on the local shards
(every torch optimizer is elementwise), so no DTensor ``_foreach_*`` op sees the fresh
0-d tensors Keras builds each step (they miss torch's sharding cache and leak into it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from keras_dtensor_fix.dtensor import DTensor, planner, to_placements
from keras_dtensor_fix.ops.values import local_tensors


def align_gradients(grads: Sequence[Any], values: Sequence[Any]) -> list[Any]:
    """Give each gradient its variable's placements (or the full value)."""
    return [_aligned(grad, value) for grad, value in zip(grads, values, strict=False)]


def _aligned(grad: Any, value: Any) -> Any:
    if grad is not None and isinstance(value, DTensor):
        return to_placements(grad, value)
    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def sharded(grads: Sequence[Any], variables: Sequence[Any]) -> bool:
    """Whether a variable or a gradient of the update is a DTensor."""
    return any(isinstance(v._value, DTensor) for v in variables) or any(
        isinstance(g, DTensor) for g in grads
    )


def _local(value: Any) -> Any:
    return value._local_tensor if isinstance(value, DTensor) else value


def update(
    optimizer: Any,
    step: Callable[..., Any],
    grads: list,
    variables: list,
    learning_rate: Any,
    *,
    local: bool = True,
    runner: Callable[..., Any] | None = None,
) -> Any:
    """``step(grads, variables, learning_rate)`` on aligned gradients and, with
    ``local`` where :func:`planner.shardwise` allows, on local shards (through
    ``runner`` when given)."""
    values = [v._value for v in variables]
    grads = align_gradients(grads, values)
    states = [getattr(variable, "_value", None) for variable in optimizer.variables]
    operands = [*values, *(g for g in grads if g is not None)]
    if not local or planner.shardwise(operands, states) is None:
        return step(grads, variables, learning_rate)
    with local_tensors(list(variables) + list(optimizer.variables)):
        grads, learning_rate = [_local(g) for g in grads], _local(learning_rate)
        return (runner or step)(grads, variables, learning_rate)


def selects_branches(optimizer: Any) -> bool:
    """Whether ``optimizer``'s update branches through ``ops.cond`` (gradient
    accumulation, EMA overwrites)."""
    return bool(
        getattr(optimizer, "gradient_accumulation_steps", None)
        or (
            getattr(optimizer, "use_ema", False)
            and getattr(optimizer, "ema_overwrite_frequency", None)
        )
    )
