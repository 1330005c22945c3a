"""A compiled function called in a loop, its dynamo guards skipped once settled.

Each call of a compiled function evaluates dynamo's guards on everything its trace read:
for a one-token call every layer attribute and weight. In a loop nothing they check
changes. :class:`Steady` runs calls with guards until one with the same
:func:`signature` as the call before (each tensor's metadata, other arguments' identity,
grad mode) converted no frame; from then on calls with that signature run under
``skip_guard_eval_unsafe``, which checks only the guards that tell cache entries apart.
Another signature must settle again.

``interleaved=True`` serves calls that take turns (each block of a step): a signature
settles once a later guarded call with it converted no frame, and several stay settled.
Not used at dynamo's recompile limit (misses would run eagerly, unseen), nor under a
stance other than the default."""

from __future__ import annotations

from collections.abc import Callable
from types import CodeType
from typing import Any

import torch

__all__ = ["Steady", "code_of", "signature"]


#: Tensor classes with no placements: their metadata is read directly (an
#: update group's call passes about a hundred such tensors).
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter})


def _meta(value: Any) -> Any:
    cls = type(value)
    if cls in _PLAIN and value.layout is torch.strided:
        return (
            cls,
            value.shape,
            value.stride(),
            value.dtype,
            value.device,
            value.requires_grad,
        )
    if isinstance(value, torch.Tensor):
        return (
            cls,
            tuple(value.shape),
            value.stride() if value.layout == torch.strided else None,
            value.dtype,
            value.device,
            value.requires_grad,
            getattr(value, "placements", None),
            id(getattr(value, "device_mesh", None)),
        )
    if isinstance(value, (tuple, list)):
        return (cls, tuple([_meta(item) for item in value]))
    return (cls, id(value))


def signature(args: tuple, kwargs: dict | None = None) -> tuple:
    """What a call's guards depend on from its arguments."""
    named = tuple((name, _meta(value)) for name, value in (kwargs or {}).items())
    return (torch.is_grad_enabled(), tuple(_meta(arg) for arg in args), named)


def _frames_converted() -> int:
    return torch._dynamo.utils.counters["frames"]["total"]


def _below_recompile_limit(code: CodeType | None) -> bool:
    try:
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code)
        limit = torch._dynamo.config.recompile_limit
    except (AttributeError, TypeError):  # another torch: guards stay on
        return False
    return 0 < len(entries) < limit


def _unguarded() -> Any:
    """torch's stance with guard evaluation skipped, or None."""
    try:
        current = torch._dynamo.eval_frame._stance
        if current.stance != "default" or current.skip_guard_eval_unsafe:
            return None
        stance = torch.compiler.set_stance(
            "default", skip_guard_eval_unsafe=True, force_backend=current.backend
        )
    except (AttributeError, RuntimeError, TypeError):
        return None  # another torch, or inside a compiled region
    return stance


class Steady:
    """``compiled`` (a ``torch.compile`` of ``code``'s function) for one loop;
    ``settled_call`` runs settled calls (without wrappers only compiling needs),
    ``fixed`` leading arguments are the same objects at every call."""

    #: Signatures remembered at most (``interleaved``); more start afresh.
    LIMIT = 256

    def __init__(
        self,
        compiled: Callable[..., Any],
        code: CodeType | None,
        *,
        interleaved: bool = False,
        settled_call: Callable[..., Any] | None = None,
        fixed: int = 0,
    ) -> None:
        self._compiled = compiled
        #: What a settled call runs: ``compiled`` without wrappers that only
        #: matter when dynamo compiles (a settled call never compiles: a
        #: failed guard raises under the stance).
        self._settled_call = settled_call or compiled
        #: Leading positional arguments that are the same objects at every
        #: call (the caller's promise): left out of the signature.
        self._fixed = fixed
        self._code = code
        self._interleaved = interleaved
        self._last: tuple | None = None
        self._seen: set[tuple] = set()
        self._settled: set[tuple] = set()

    @property
    def settled(self) -> bool:
        """Whether calls with the last signature skip their guards."""
        return self._last in self._settled

    def reset(self) -> None:
        """Evaluate every signature's guards again until it settles again."""
        self._last = None
        self._seen.clear()
        self._settled.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = signature(args[self._fixed :], kwargs)
        if key in self._settled:
            stance = _unguarded()
            if stance is not None:
                self._last = key
                with stance:
                    return self._settled_call(*args, **kwargs)
        before = _frames_converted()
        result = self._compiled(*args, **kwargs)
        repeated = key in self._seen if self._interleaved else key == self._last
        if (
            repeated
            and _frames_converted() == before
            and _below_recompile_limit(self._code)
        ):
            if not self._interleaved:
                self._settled.clear()
            self._settled.add(key)
        if len(self._seen) >= self.LIMIT:
            self.reset()
        self._seen.add(key)
        self._last = key
        return result


def code_of(function: Any) -> CodeType | None:
    """The code object ``torch.compile`` keys its cache entries by."""
    function = getattr(function, "__func__", function)
    return getattr(function, "__code__", None)
