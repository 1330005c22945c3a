"""Post-import hooks: one per module name, never run on a half-imported module (one
still importing is held back until the next hook: :func:`ready`)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Iterator

import wrapt

from keras_dtensor_fix.engine import targets

__all__ = ["ensure", "fired", "forget_held", "ready"]

Hook = Callable[[types.ModuleType], None]

_registered: set[str] = set()  # module names with a hook not fired yet
_held: dict[str, None] = {}  # half-imported at activation, in order


def ensure(name: str, hook: Hook) -> None:
    """Run ``hook`` on module ``name`` now if it is imported, else when it is."""
    if (module := sys.modules.get(name)) is not None:
        if targets.initializing(module):
            _held[name] = None
            return
        hook(module)
    elif name not in _registered:
        _registered.add(name)
        wrapt.register_post_import_hook(hook, name)


def fired(module: types.ModuleType) -> None:
    """Note that ``module``'s hook ran: a later import registers a new one."""
    if sys.modules.get(module.__name__) is module:
        _registered.discard(module.__name__)


def ready(hook: Hook) -> Iterator[types.ModuleType]:
    """The held-back modules whose import has finished since (one gone from
    ``sys.modules`` gets a hook again)."""
    for name in list(_held):
        module = sys.modules.get(name)
        if module is None or not targets.initializing(module):
            _held.pop(name, None)
            if module is not None:
                yield module
            else:
                ensure(name, hook)


def forget_held() -> None:
    """Drop the held-back modules (on deactivation)."""
    _held.clear()
