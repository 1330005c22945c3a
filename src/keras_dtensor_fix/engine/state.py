"""Run-time state the families share: the sharding gate, the active ModelParallel
distribution, whether dynamo traces, and the attributes set on Keras objects
(:func:`set_attribute`, undone on deactivation). Standard library only at import."""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

from keras_dtensor_fix.engine import targets

#: Non-empty once a sharded (DTensor) distribution is in use in this process
#: (emptied for the length of a decoder block's call on local tensors, where
#: every operand is plain: ``generation/decoder.py``).
#: A list, so that wrapt's C code tests it (``enabled=``) without a Python call.
SHARDING: list[bool] = []
#: Non-empty for the length of such a local call: a ``traced`` module
#: function's wrapper still runs in a graph traced there (a tensor start's
#: slice must become a gather on local tensors too), though the gate is shut.
LOCAL_CALL: list[bool] = []


def note_sharding() -> None:
    """Open the gated wrappers: DTensors may now meet plain tensors."""
    if not SHARDING:
        SHARDING.append(True)


def model_parallel() -> Any | None:
    """The active Keras distribution when it shards with DTensors (not
    ``DataParallel``), else None."""
    distribution_lib = sys.modules.get(targets.DISTRIBUTION_API)
    if distribution_lib is None or not hasattr(distribution_lib, "DataParallel"):
        return None  # not (fully) imported yet: no distribution can be set
    dist = distribution_lib.distribution()  # None: no distribution set
    return None if isinstance(dist, distribution_lib.DataParallel) else dist


def compiling() -> bool:
    """Whether torch.compile (dynamo) is tracing the current frame."""
    import torch

    return bool(torch.compiler.is_compiling())


#: The class of the global dispatch mode Keras enters under a distribution.
PROMOTION_MODE = "KerasDTensorPromotionMode"


def promotion_modes() -> list[object]:
    """Keras promotion modes on this thread's dispatch stack (empty when off)."""
    if "torch" not in sys.modules:
        return []
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    stack = _get_current_dispatch_mode_stack()
    return [mode for mode in stack if type(mode).__name__ == PROMOTION_MODE]


_ABSENT = object()
_lock = threading.Lock()
#: id(object) -> (weak or strong reference, {attribute: value before})
_set: dict[int, tuple[Any, dict[str, Any]]] = {}
#: (object, attribute) set while dynamo traced, absent before.
_PENDING: list[tuple[Any, str]] = []


def set_attribute(obj: Any, name: str, value: Any) -> None:
    """``setattr(obj, name, value)``, undone on deactivation: the first value seen is
    restored (or deleted); objects held weakly where they allow it."""
    if compiling():
        # Dynamo (torch 2.13) cannot trace the lock or the weak reference; a list
        # append is a side effect it replays. Attributes set only here are
        # the plugin's own caches, absent before: undone by deleting them.
        _PENDING.append((obj, name))
    else:
        before = getattr(obj, "__dict__", {}).get(name, _ABSENT)
        with _lock:
            _record(obj).setdefault(name, before)
    setattr(obj, name, value)


def _record(obj: Any) -> dict[str, Any]:
    """The attributes recorded for ``obj`` (a new entry if none); under _lock."""
    key = id(obj)
    entry = _set.get(key)
    if entry is None or _target(entry[0]) is not obj:
        try:
            ref: Any = weakref.ref(obj, lambda _, key=key: _forget(key))
        except TypeError:
            ref = obj
        entry = _set[key] = (ref, {})
    return entry[1]


def _target(ref: Any) -> Any:
    return ref() if isinstance(ref, weakref.ref) else ref


def _forget(key: int) -> None:
    with _lock:
        entry = _set.get(key)
        if entry is not None and _target(entry[0]) is None:
            del _set[key]


def undo_attributes() -> None:
    """Put back every attribute :func:`set_attribute` changed (those set while dynamo
    traced first: a value recorded outside a trace is older)."""
    with _lock:
        entries = [(obj, {name: _ABSENT}) for obj, name in _PENDING]
        entries += [(_target(ref), before) for ref, before in _set.values()]
        _PENDING.clear()
        _set.clear()
    for obj, before in entries:
        if obj is None:
            continue
        for name, value in before.items():
            try:
                if value is _ABSENT:
                    namespace = getattr(obj, "__dict__", {})
                    if isinstance(namespace, dict):
                        namespace.pop(name, None)
                    elif name in namespace:  # a class: a read-only mapping
                        delattr(obj, name)
                else:
                    setattr(obj, name, value)
            except (AttributeError, TypeError):
                continue
