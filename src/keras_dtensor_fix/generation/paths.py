"""Which path each model and decoder block generates on, learned once.

One record per object, held weakly, in place of a set per outcome. A model's
``eager`` is set once its compiled token step failed (it generates eagerly
from then on, as with ``jit_compile=False``); its ``whole`` is
:data:`CHECKED` once its whole token call on local tensors matched the
DTensor path, :data:`DTENSOR` once it did not (or a block of it did not).
A decoder block's ``block`` is the same for its own local call.
"""

from __future__ import annotations

import weakref
from typing import Any

CHECKED, DTENSOR = "checked", "dtensor"

_RECORDS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def eager(model: Any) -> bool:
    """Whether ``model``'s compiled token step failed."""
    return bool(_RECORDS.get(model, {}).get("eager"))


def whole(model: Any) -> str | None:
    """``model``'s whole-call outcome: :data:`CHECKED`, :data:`DTENSOR` or None."""
    return _RECORDS.get(model, {}).get("whole")


def block(layer: Any) -> str | None:
    """A decoder block's outcome: :data:`CHECKED`, :data:`DTENSOR` or None."""
    return _RECORDS.get(layer, {}).get("block")


def mark(obj: Any, **outcome: Any) -> None:
    """Record ``outcome`` (``eager=``, ``whole=``, ``block=``) for ``obj``."""
    _RECORDS.setdefault(obj, {}).update(outcome)


def forget() -> None:
    """Every outcome (on deactivation)."""
    _RECORDS.clear()
