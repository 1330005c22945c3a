"""Replace Keras's global ``KerasDTensorPromotionMode`` with DTensor's own switch.

Upstream enters a ``TorchDispatchMode`` in ``set_distribution`` that promotes
every plain tensor to a Replicate DTensor: every aten call goes through
Python and dynamo skips every frame. The plugin keeps it off and, while a
sharded distribution is set, turns on DTensor's implicit replication (the
same semantics where a raw torch op meets a plain tensor and a DTensor, in
C). ``keras.ops`` still see their operands first (``numpy``, ``ops``).
"""

from __future__ import annotations

import sys
import types

from torch.utils._python_dispatch import _get_current_dispatch_mode

from keras_dtensor_fix.dtensor import implicit_replication, set_implicit_replication
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require
from keras_dtensor_fix.engine.state import (
    PROMOTION_MODE,
    model_parallel,
    note_sharding,
    promotion_modes,
)


def _skip_activation(wrapped, instance, args, kwargs):
    """``activate_dtensor_promotion``: no mode; DTensor's switch on this thread and the
    gated wrappers open."""
    note_sharding()
    set_implicit_replication(True)
    return None


def _deactivation(wrapped, instance, args, kwargs):
    """``deactivate_dtensor_promotion``: Keras's own, then the switch goes off."""
    try:
        return wrapped(*args, **kwargs)
    finally:
        set_implicit_replication(False)


def patches(module: types.ModuleType) -> list[Patch]:
    why = "this Keras has no promotion mode"
    name, activate = module.__name__, require(module, "activate_dtensor_promotion", why)
    found = [Patch(name, activate, _skip_activation)]
    if hasattr(module, "deactivate_dtensor_promotion"):
        found.append(Patch(name, "deactivate_dtensor_promotion", _deactivation))
    return found


def after_apply() -> None:
    """Exit a promotion mode entered before the plugin was activated."""
    module = sys.modules.get(targets.DISTRIBUTION_LIB)
    if promotion_modes() and hasattr(module, "deactivate_dtensor_promotion"):
        module.deactivate_dtensor_promotion()  # keeps Keras's own flags right
    while promotion_modes():
        mode = _get_current_dispatch_mode()
        if type(mode).__name__ != PROMOTION_MODE:
            # Another mode sits on top of it: popping would remove that one.
            raise RuntimeError(
                f"{PROMOTION_MODE} is under another dispatch mode "
                f"({type(mode).__name__}) and cannot be exited"
            )
        mode.__exit__(None, None, None)
    if model_parallel() is not None:
        note_sharding()
        set_implicit_replication(True)


def after_revert() -> None:
    """Give upstream its mode back when a ModelParallel distribution is active."""
    set_implicit_replication(False)
    module = sys.modules.get(targets.DISTRIBUTION_LIB)
    if module is not None and model_parallel() is not None:
        module.activate_dtensor_promotion()


def notes() -> list[str]:
    """Whether Keras's promotion mode is on the stack, and DTensor's switch."""
    if "torch" not in sys.modules:
        return []
    if promotion_modes():
        return [
            f"{PROMOTION_MODE} is on the dispatch stack (entered under another mode)"
        ]
    switch = "on" if implicit_replication() else "off"
    return [
        f"{PROMOTION_MODE} is not on the dispatch stack; DTensor implicit "
        f"replication of plain tensors is {switch} on this thread"
    ]


IMPLEMENTATION = Implementation(patches, after_apply, after_revert, notes)
