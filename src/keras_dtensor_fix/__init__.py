"""keras-dtensor-fix: make ``keras.distribution.ModelParallel`` work on torch.

Importing the package (or, once installed, starting Python: a ``.pth`` file) activates
the fix unless ``KERAS_DTENSOR_FIX`` says off; patches land when Keras's torch backend
modules are imported."""

from __future__ import annotations

import sys
from typing import Any

from keras_dtensor_fix import _bootstrap
from keras_dtensor_fix._version import __version__

__all__ = [
    "__version__",
    "activate",
    "auto_layout_map",
    "deactivate",
    "is_active",
    "status",
]


def activate(*, strict: bool | None = None) -> None:
    """Patch Keras's torch backend now and on every later import (also when
    ``KERAS_DTENSOR_FIX`` is off). ``strict=True`` (or ``KERAS_DTENSOR_FIX_STRICT=1``):
    a patch that cannot apply raises. Idempotent."""
    from keras_dtensor_fix.engine import patcher

    patcher.activate(strict=strict)


def deactivate() -> None:
    """Restore every patched object (the very same objects) and stop patching."""
    if (patcher := _patcher()) is not None:
        patcher.deactivate()


def is_active() -> bool:
    """Whether the fix is active in this process."""
    return (patcher := _patcher()) is not None and patcher.is_active()


def __getattr__(name: str) -> Any:
    """``auto_layout_map``, loaded on first use (the planner imports torch)."""
    if name != "auto_layout_map":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from keras_dtensor_fix.planning.auto import auto_layout_map

    return auto_layout_map


def _patcher() -> Any:
    """The engine's patcher where loaded (not loaded: nothing was patched)."""
    return sys.modules.get(f"{__name__}.engine.patcher")


def status() -> dict[str, Any]:
    """A structured report: versions, backend, layout, ``enabled`` and ``why``,
    ``gate``, ``disabled_families``, ``targets`` (a row per patch: family, module,
    attribute, state, cause, reason), ``warnings``, ``notes``. Imports neither keras
    nor torch."""
    from keras_dtensor_fix import report

    return report.report()


_bootstrap.boot()
