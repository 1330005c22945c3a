"""keras-dtensor-fix's interpreter-start hook, run by its ``.pth`` (``.start``).

The ``.pth`` runs in every Python process of the environment (pip, pytest, a linter), so
this module only reads ``KERAS_DTENSOR_FIX`` and puts a finder on ``sys.meta_path`` that
finds nothing: the first import of one of :data:`WATCHED` imports ``keras_dtensor_fix``,
whose import activates the fix, the way ddtrace's and OpenTelemetry's site hooks wait
for the library they patch. It lives outside the package because importing the package
is what activates, and so holds the one parser of ``KERAS_DTENSOR_FIX``
(:func:`parse_enabled`, which ``engine.config`` imports). Standard library already
loaded at start only; never raises."""

import os
import sys

#: Top-level packages whose first import activates the fix: every patch
#: family targets a ``keras`` or a ``torch`` module (torchrun's agent imports
#: torch and never Keras).
WATCHED = frozenset({"keras", "torch"})
PACKAGE = "keras_dtensor_fix"
ENV_ENABLE = "KERAS_DTENSOR_FIX"
OFF_VALUES: tuple[str, ...] = ("0", "false", "off", "no")
ON_VALUES: tuple[str, ...] = ("1", "true", "on", "yes")


def parse_enabled(raw: str | None) -> tuple[bool, str, str | None]:
    """Parse ``KERAS_DTENSOR_FIX``: ``(enabled, reason, warning or None)``."""
    value = (raw or "").strip().lower()
    if not value:
        return True, f"{ENV_ENABLE} unset: on by default", None
    if value in OFF_VALUES:
        return False, f"{ENV_ENABLE}={raw!r} turns the fix off", None
    if value in ON_VALUES:
        return True, f"{ENV_ENABLE}={raw!r} turns the fix on", None
    message = (
        f"{ENV_ENABLE}={raw!r} is not understood; accepted values are "
        f"{'/'.join(ON_VALUES)} (on) and {'/'.join(OFF_VALUES)} (off), "
        "case-insensitive; using the default (on)"
    )
    return True, f"{ENV_ENABLE}={raw!r} not understood: on by default", message


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
        finders = (getattr(finder, "find_spec", None) for finder in list(sys.meta_path))
        specs = (find(name, path, target) for find in finders if find is not None)
        return next((spec for spec in specs if spec is not None), None)


_watcher: Watcher | None = None


def boot() -> None:
    """Arm the watcher unless ``KERAS_DTENSOR_FIX`` says off (idempotent); with the
    package or a watched one already imported, activate at once."""
    global _watcher
    try:
        if PACKAGE in sys.modules or not parse_enabled(os.environ.get(ENV_ENABLE))[0]:
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
    if watcher in sys.meta_path:
        sys.meta_path.remove(watcher)
    return True


def _log_failure() -> None:
    import logging

    logging.getLogger(PACKAGE).warning(
        "keras_dtensor_fix: start-up activation failed", exc_info=True
    )
