"""A local fast path's first call on each object, checked against DTensor's.

A fast path (a layer, a decoder block or a model's token on local tensors)
that recognised wrongly would raise mid-step or, worse, silently give other
numbers. So each object's first call runs both (:meth:`FirstCall.run`): the
fast path, then the object's own call on DTensors without gradients, its
writes undone, and compares outputs and written variables as every process
finds them (one all-reduce: every process decides alike). Where the fast path
raised or differs, one warning names the object and the cause, and the object
runs its own call from then on. Objects are held weakly.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from keras_dtensor_fix.dtensor import DTensor, all_reduce_sum
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.ops.values import full_value

__all__ = ["PROVEN", "REFUSED", "UNKNOWN", "FirstCall", "first_line"]

#: What :meth:`FirstCall.known` says of an object: not yet checked, its fast
#: path matched, or it failed (its own call from then on).
UNKNOWN, PROVEN, REFUSED = None, True, False

_SAY = (
    "{name} on {owner} {cause}; it runs on DTensors from now on, as upstream "
    "Keras runs it."
)


class FirstCall:
    """The first-call check of one fast path, and what it learnt per object.

    ``say`` is the warning (``{name}``, ``{owner}``, ``{cause}``); ``raised``
    (``{error}``) and ``differs`` the causes :meth:`run` finds.
    """

    def __init__(
        self,
        name: str,
        say: str = _SAY,
        raised: str = "raised ({error})",
        differs: str = "did not match DTensor's path",
    ) -> None:
        self.name, self.say, self.raised, self.differs = name, say, raised, differs
        self._known: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def known(self, owner: Any) -> bool | None:
        """:data:`PROVEN`, :data:`REFUSED` or :data:`UNKNOWN` for ``owner``."""
        return self._known.get(owner)

    def remember(self, owner: Any, outcome: bool) -> None:
        """Set ``owner``'s outcome without a warning."""
        self._known[owner] = outcome

    def refuse(self, owner: Any, cause: str) -> None:
        """``owner`` calls its own from now on: one warning naming ``cause``."""
        self.remember(owner, REFUSED)
        name = getattr(owner, "name", None) or type(owner).__name__
        message = self.say.format(name=self.name, owner=name, cause=cause)
        warnings.warn(f"keras-dtensor-fix: {message}", stacklevel=4)

    def forget(self) -> None:
        """Forget every outcome (on deactivation)."""
        self._known.clear()

    def run(
        self,
        owner: Any,
        fast: Callable[[], Any],
        own: Callable[[], Any],
        written: Sequence[Any] = (),
        compared: Callable[[Any], Any] | None = None,
    ) -> Any:
        """``owner``'s call: ``fast()`` once proven, ``own()`` once refused,
        and on the first call ``fast()`` checked against ``own()``.

        ``fast()`` returns None to decline (``own()`` then runs, nothing is
        learnt); ``written`` are the variables a call may assign;
        ``compared`` gives what of the fast result stands for ``own()``'s
        (the fast result itself by default).
        """
        known = self.known(owner)
        if known is not UNKNOWN:
            result = fast() if known else None
            return own() if result is None else result
        before = _state(owner, written)
        try:
            result, error = fast(), None
        except Exception as caught:
            result, error = None, caught
        if result is None and error is None:
            return own()
        after = _state(owner, written)
        _restore(owner, written, before)
        try:
            with torch.no_grad():
                expected = own()
        except Exception:
            # DTensor's path fails too: nothing to check against.
            if error is not None:
                raise error from None
            _restore(owner, written, after)
            return result
        if error is None:
            cause, view = self.differs, result if compared is None else compared(result)
        else:
            cause, view = self.raised.format(error=first_line(error)), None
        pairs = _pairs(expected, view)
        pairs += list(zip(_state(owner, written)[0], after[0], strict=True))
        if _agree(pairs, error is None):
            self.remember(owner, PROVEN)
            _restore(owner, written, after)
            return result
        if error is None and all(close for *_, close in pairs):
            cause += " on another process"
        _restore(owner, written, before)
        self.refuse(owner, cause)
        return own()


def first_line(error: BaseException) -> str:
    """``Type: first line`` of ``error``, for a warning or a report; a dynamo
    failure names its ``inner_exception``, the step's own error."""
    error = getattr(error, "inner_exception", None) or error
    lines = [line for line in str(error).splitlines() if line.strip()]
    name = type(error).__name__
    return f"{name}: {lines[0][:200]}" if lines else name


def _state(owner: Any, written: Sequence[Any]) -> tuple[list[Any], list | None]:
    """The ``written`` variables' values and ``owner``'s ``add_loss`` list."""
    losses = getattr(owner, "_losses", None)
    values = [variable._value.detach().clone() for variable in written]
    return values, list(losses) if isinstance(losses, list) else None


def _restore(owner: Any, written: Sequence[Any], state: tuple) -> None:
    values, losses = state
    with torch.no_grad():
        for variable, value in zip(written, values, strict=True):
            variable._value.copy_(value)
    if losses is not None:
        owner._losses[:] = losses


def _pairs(expected: Any, result: Any) -> list[tuple[Any, Any]]:
    """(DTensor's, the fast path's) tensors; the fast path's missing or shaped
    otherwise, None in its place (the same gathers on every process)."""
    flatten = targets.keras_object("tree").flatten
    want = [v for v in flatten(expected) if isinstance(v, torch.Tensor)]
    got = [v for v in flatten(result) if isinstance(v, torch.Tensor)]
    if len(got) != len(want):
        return [(a, None) for a in want]
    return list(zip(want, got, strict=True))


def _close(a: Any, b: Any) -> bool:
    if b is None or a.shape != b.shape:
        return False
    rtol = 1e-2 if a.dtype in (torch.float16, torch.bfloat16) else 1e-4
    a, b = a.detach().float(), b.detach().float()
    scale = float(a.abs().max()) if a.numel() else 0.0
    return bool(torch.allclose(a, b, rtol=rtol, atol=rtol * 0.1 * max(scale, 1.0)))


def _agree(pairs: list, ok: bool) -> bool:
    """Whether every process's pairs hold the same values (gathers and one
    all-reduce, alike on every process); ``pairs`` becomes (a, b, close)."""
    mesh = None
    with torch.no_grad():
        for index, (a, b) in enumerate(pairs):
            if mesh is None and isinstance(a, DTensor):
                mesh = a.device_mesh
            full_a, full_b = full_value((a, a if b is None else b))
            close = b is not None and _close(full_a, full_b)
            pairs[index] = (a, b, close)
            ok = ok and close
        if mesh is None:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=mesh.device_type)
        total = all_reduce_sum(flag, mesh, tuple(range(mesh.ndim)))
    return float(total) == 0.0
