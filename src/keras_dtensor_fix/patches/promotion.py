"""Keep Keras's global ``KerasDTensorPromotionMode`` off the dispatch stack.

Upstream enters a ``TorchDispatchMode`` in ``set_distribution`` that promotes
every plain tensor to a Replicate DTensor. It costs every aten call a trip
through Python and makes dynamo skip every frame. The plugin's targeted patches
(``variables``, ``numpy``, ``data``, ``optimizers``) make it unnecessary.
"""

from __future__ import annotations

import sys
import types

from keras_dtensor_fix.engine import Patch, note_sharding

FAMILY = "promotion"
MODULES = ("keras.src.backend.torch.distribution_lib",)
MODE_CLASS = "KerasDTensorPromotionMode"


def _skip_activation(wrapped, instance, args, kwargs):
    """Replacement for ``activate_dtensor_promotion``: do not enter the mode.

    Keras calls it when a sharding distribution is set: the plugin's gated
    wrappers open instead.
    """
    note_sharding()
    return None


def patches(module: types.ModuleType) -> list[Patch]:
    if not hasattr(module, "activate_dtensor_promotion"):
        raise LookupError(
            "activate_dtensor_promotion not found: this Keras has no promotion mode"
        )
    return [
        Patch(FAMILY, module.__name__, "activate_dtensor_promotion", _skip_activation)
    ]


def promotion_modes() -> list[object]:
    """Keras promotion modes on this thread's dispatch stack (empty when off)."""
    if "torch" not in sys.modules:
        return []
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return [
        m for m in _get_current_dispatch_mode_stack() if type(m).__name__ == MODE_CLASS
    ]


def after_apply() -> None:
    """Exit a promotion mode entered before the plugin was activated."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from keras_dtensor_fix.keras_state import model_parallel

    if model_parallel() is not None:
        note_sharding()
    module = sys.modules.get(MODULES[0])
    if promotion_modes() and hasattr(module, "deactivate_dtensor_promotion"):
        module.deactivate_dtensor_promotion()  # keeps Keras's own flags right
    while promotion_modes():
        mode = _get_current_dispatch_mode()
        if type(mode).__name__ != MODE_CLASS:
            # Another mode sits on top of it: popping would remove that one.
            raise RuntimeError(
                f"{MODE_CLASS} is under another dispatch mode "
                f"({type(mode).__name__}) and cannot be exited"
            )
        mode.__exit__(None, None, None)


def after_revert() -> None:
    """Give upstream its mode back when a ModelParallel distribution is active."""
    from keras_dtensor_fix.keras_state import model_parallel

    module = sys.modules.get(MODULES[0])
    if module is not None and model_parallel() is not None:
        module.activate_dtensor_promotion()


def notes() -> list[str]:
    """Whether Keras's promotion mode is on this thread's dispatch stack."""
    if "torch" not in sys.modules:
        return []
    if promotion_modes():
        return [f"{MODE_CLASS} is on the dispatch stack (entered under another mode)"]
    return [f"{MODE_CLASS} is not on the dispatch stack"]
