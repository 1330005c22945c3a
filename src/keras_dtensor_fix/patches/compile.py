"""Let ``jit_compile=True`` run torch.compile under ModelParallel.

Upstream refuses it ("Running without `torch.compile`") because its promotion
mode makes dynamo skip every frame. With the mode kept off (``promotion``
family) the step compiles to a graph like any other.
"""

from __future__ import annotations

import sys
import types

from keras_dtensor_fix.engine import Patch

FAMILY = "compile"
MODULES = ("keras.src.backend.torch.trainer",)


def _promotion_mode_off() -> bool:
    promotion = sys.modules.get("keras_dtensor_fix.patches.promotion")
    return promotion is not None and not promotion.promotion_modes()


def _use_torch_compile(wrapped, instance, args, kwargs):
    from keras_dtensor_fix.keras_state import model_parallel

    if model_parallel() is None or not _promotion_mode_off():
        return wrapped(*args, **kwargs)
    return bool(instance.jit_compile) and not instance.run_eagerly


def patches(module: types.ModuleType) -> list[Patch]:
    if "_use_torch_compile" not in vars(module.Trainer):
        raise LookupError(
            "Trainer._use_torch_compile not found: this Keras does not refuse "
            "torch.compile under ModelParallel"
        )
    return [
        Patch(FAMILY, module.__name__, "Trainer._use_torch_compile", _use_torch_compile)
    ]
