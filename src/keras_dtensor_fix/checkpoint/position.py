"""Where ``fit`` is in its data: what a step's checkpoint needs to resume there.

The batches done and what orders the epoch's data: the adapter's epoch
counter (Keras's shuffles seed from it) and the random states at the epoch's
start (a ``DataLoader``'s seed) and at the step (unseeded dropout). The
``Checkpoint`` callback arms :func:`capture` and :func:`plan`; the ``resume``
family calls :func:`entering` and :func:`skipped`. Standard library only at
import.
"""

from __future__ import annotations

import base64
import random
import weakref
from typing import Any

_capture = False
_iterator: weakref.ref | None = None
_adapter_epoch: int | None = None
_plan: tuple[int, int | None] | None = None
_after: dict[str, Any] | None = None  # random states after the skip


def capture() -> None:
    """Record the next epoch iterator that starts (the training one)."""
    global _capture, _adapter_epoch
    _capture, _adapter_epoch = True, None


def plan(
    skip: int, adapter_epoch: int | None, after: dict[str, Any] | None = None
) -> None:
    """Have the next epoch skip ``skip`` batches, its data ordered as saved;
    ``after``: the random states to put back once they are skipped."""
    global _plan, _after
    _plan, _after = (skip, adapter_epoch), after


def consumed() -> bool:
    """Whether the last :func:`plan` left no batches to skip untaken (with
    none to skip, no iterator need take it: the plugin off)."""
    return _plan is None or _plan[0] == 0


def entering(iterator: Any) -> int:
    """``iterator`` starts an epoch: apply the plan, record; batches to skip."""
    global _capture, _iterator, _adapter_epoch, _plan
    skip = 0
    adapter = getattr(iterator, "data_adapter", None)
    if _plan is not None:
        (skip, epoch), _plan = _plan, None
        if epoch is not None and hasattr(adapter, "_epoch"):
            adapter._epoch = epoch
    if _capture:
        _capture, _iterator = False, weakref.ref(iterator)
        _adapter_epoch = getattr(adapter, "_epoch", None)
    return skip


def skipped() -> None:
    """The planned batches are drawn: the random states as at the save."""
    global _after
    after, _after = _after, None
    restore_random(after)


def adapter_epoch(at_epoch_begin: bool) -> int | None:
    """The training adapter's epoch counter, at this epoch's begin or now."""
    if at_epoch_begin:
        return _adapter_epoch
    iterator = _iterator() if _iterator is not None else None
    return getattr(getattr(iterator, "data_adapter", None), "_epoch", None)


def random_state() -> dict[str, Any]:
    """Python's, numpy's and torch's global random states, JSON-able."""
    import numpy as np
    import torch

    kind, keys, pos, gauss, cached = np.random.get_state()
    return {
        "python": [list(s) if isinstance(s, tuple) else s for s in random.getstate()],
        "numpy": [kind, keys.tolist(), pos, gauss, cached],
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
    }


def restore_random(state: dict[str, Any] | None) -> None:
    """Put back what :func:`random_state` recorded (None: nothing)."""
    if state is None:
        return
    import numpy as np
    import torch

    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state(
        (kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached)
    )
    raw = base64.b64decode(state["torch"])
    torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
