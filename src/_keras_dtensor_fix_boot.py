"""keras-dtensor-fix's interpreter-start hook, run by its ``.pth`` (``.start``).

The ``.pth`` runs in every Python process of the environment (pip, pytest, a
linter), so this module only reads ``KERAS_DTENSOR_FIX`` and puts a finder on
``sys.meta_path`` that finds nothing: the first import of one of
:data:`WATCHED` imports ``keras_dtensor_fix``, whose import activates the fix,
the way ddtrace's and OpenTelemetry's site hooks wait for the library they
patch. It lives outside the package because importing the package is what
activates. Standard library already loaded at start only; never raises.
"""

import os
import sys

#: Top-level packages whose first import activates the fix: every patch
#: family targets a ``keras`` or a ``torch`` module (torchrun's agent imports
#: torch and never Keras).
WATCHED = frozenset({"keras", "torch"})
PACKAGE = "keras_dtensor_fix"
ENV_ENABLE = "KERAS_DTENSOR_FIX"
#: ``keras_dtensor_fix.engine.config.OFF_VALUES`` (a test keeps them equal).
OFF_VALUES = ("0", "false", "off", "no")


class Watcher:
    """Activates the fix on the first import of a watched package, then
    leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: object = None, target: object = None):
        if name == PACKAGE:  # imported by other means: that import activates
            disarm()
            return None
        if name not in WATCHED or not disarm():
            return None
        try:
            __import__(PACKAGE)
        except Exception:  # noqa: BLE001 - never break the import that woke us
            _log_failure()
            return None
        # Activation put wrapt's post-import finder on sys.meta_path after the
        # import machinery took the finders to try for ``name``: ask them
        # again, so that the watched package's own hooks fire too.
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            if find is not None:
                spec = find(name, path, target)
                if spec is not None:
                    return spec
        return None


_watcher: Watcher | None = None


def boot() -> None:
    """Arm the watcher unless ``KERAS_DTENSOR_FIX`` says off (idempotent).

    With the package or a watched one already imported, activate at once.
    """
    global _watcher
    try:
        if os.environ.get(ENV_ENABLE, "").strip().lower() in OFF_VALUES:
            return
        if PACKAGE in sys.modules:
            return
        if any(name in sys.modules for name in WATCHED):
            __import__(PACKAGE)
            return
        if _watcher is None:
            _watcher = Watcher()
            sys.meta_path.insert(0, _watcher)
    except Exception:  # noqa: BLE001 - interpreter start must never fail here
        _log_failure()


def disarm() -> bool:
    """Take the watcher off ``sys.meta_path``; whether it was on."""
    global _watcher
    watcher, _watcher = _watcher, None
    if watcher is None:
        return False
    try:
        sys.meta_path.remove(watcher)
    except ValueError:
        pass
    return True


def _log_failure() -> None:
    import logging

    logging.getLogger(PACKAGE).warning(
        "keras_dtensor_fix: start-up activation failed", exc_info=True
    )
