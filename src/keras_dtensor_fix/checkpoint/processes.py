"""Which process acts for a checkpoint: the first, and every process learns.

Through :func:`keras_dtensor_fix.saving.handshake.one_acts` (the store, no
collective), so a failure on the first process is an error on all, not a hang.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_dtensor_fix.checkpoint.files import CheckpointError
from keras_dtensor_fix.dtensor import world as place
from keras_dtensor_fix.engine import config
from keras_dtensor_fix.saving import handshake

HINT = (
    "Every process must take part in a checkpoint's save and restore; one did "
    f"not arrive. Raise {config.ENV_SAVE_TIMEOUT} if saves take longer."
)


def on_first(fn: Callable[..., Any], *args: Any, scope: str = "checkpoint") -> Any:
    """Run ``fn`` on the first process; all return its (JSON) result or raise.

    Calls meet by ``scope`` and ``fn``: another thread's save (preemption's)
    passes its own scope, so it never meets the main thread's.
    """
    what = f"{scope}: {getattr(fn, '__name__', 'step')}"
    return _learn(what, (lambda: fn(*args)) if place.rank() == 0 else None)[0]


def every_process(what: str, check: Callable[[], Any]) -> None:
    """``check()`` on every process; each raises if it failed anywhere."""
    _learn(f"checkpoint: {what}", check)


def _learn(what: str, act: Callable[[], Any] | None) -> list[Any]:
    return handshake.one_acts(
        what,
        act,
        HINT,
        lambda failed: CheckpointError(f"{what} failed on {failed}"),
        own=True,
    )
