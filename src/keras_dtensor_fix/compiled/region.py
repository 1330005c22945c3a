"""One compiled piece of a step: what every function the plugin compiles shares.

A block, the tail, the update per block and generation's token step each run through a
:class:`Region`: ``torch.compile`` with static shapes (DTensor fails on symbolic sizes:
torch 2.13, pytorch/pytorch#152963), the per-process cache tag (:mod:`.cache_key`),
views recomputed in the backward, guards skipped once settled (:class:`Steady`), a code
object of its own (dynamo counts cache entries per code object) and, where
torch.compile fails (:mod:`.failure`), one warning and the eager code from then on.
"""

from __future__ import annotations

import contextlib
import types
import warnings
import weakref
from collections.abc import Callable, Iterator
from types import CodeType
from typing import Any

import torch

from keras_dtensor_fix.compiled import cache_key, failure
from keras_dtensor_fix.engine import state, targets
from keras_dtensor_fix.ops.first_call import first_line

__all__ = [
    "SCOPELESS",
    "Region",
    "eligible",
    "forget",
    "name_scope",
    "of_class",
    "reset_all",
    "scopeless",
]

#: True while a block's or the tail's region runs: its sublayers open no name scope.
SCOPELESS: list[bool] = []


@contextlib.contextmanager
def scopeless() -> Iterator[None]:
    """Inside: no Keras name scope open, and sublayers open none (a sublayer's path
    would be a guard: a graph per block instance)."""
    stack = targets.keras_object("global_state").get_global_attribute(
        "name_scope_stack"
    )
    saved = list(stack) if stack else []
    if stack:
        stack.clear()
    SCOPELESS.append(True)
    try:
        yield
    finally:
        SCOPELESS.pop()
        if stack is not None:
            stack[:] = saved


def name_scope(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict):
    """``Layer._open_name_scope``'s wrapper: no scope inside :func:`scopeless`."""
    if SCOPELESS:
        return contextlib.nullcontext()
    return wrapped(*args, **kwargs)


def eligible() -> bool:
    """Whether a region may run now: grad mode on, not traced, under ModelParallel,
    outside Keras's symbolic and stateless calls."""
    return (
        torch.is_grad_enabled()
        and not state.compiling()
        and state.model_parallel() is not None
        and not targets.keras_object("in_symbolic_scope")()
        and not targets.keras_object("in_stateless_scope")()
    )


def renamed(function: Callable[..., Any], qualname: str) -> Any:
    """``function`` with a code object of its own named ``qualname``."""
    name = qualname.rsplit(".", 1)[-1]
    code = function.__code__.replace(co_qualname=qualname, co_name=name)
    named = types.FunctionType(
        code, function.__globals__, name, function.__defaults__, function.__closure__
    )
    named.__qualname__ = qualname
    return named


def _meta(value: Any) -> Any:
    cls = type(value)
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
        return torch.compiler.set_stance(
            "default", skip_guard_eval_unsafe=True, force_backend=current.backend
        )
    except (AttributeError, RuntimeError, TypeError):
        return None  # another torch, or inside a compiled region


class Steady:
    """``compiled`` (a ``torch.compile`` of ``code``'s function) for one loop.

    Each compiled call evaluates dynamo's guards on all its trace read (for a token
    step every layer attribute and weight), none of which changes in a loop. Once a
    call with the :func:`signature` of an earlier one (the one before, or any with
    ``interleaved``: blocks take turns) converted no frame, calls with it run under
    ``skip_guard_eval_unsafe``, which checks only the guards telling cache entries
    apart. Not at dynamo's recompile limit (misses would run eagerly, unseen), nor
    under a stance other than the default. ``settled_call`` runs settled calls
    (without wrappers only compiling needs: a failed guard raises under the stance)."""

    #: Signatures remembered at most (``interleaved``); more start afresh.
    LIMIT = 256

    def __init__(
        self,
        compiled: Callable[..., Any],
        code: CodeType | None,
        *,
        interleaved: bool = False,
        settled_call: Callable[..., Any] | None = None,
    ) -> None:
        self._compiled = compiled
        self._settled_call = settled_call or compiled
        self._code = code
        self._interleaved = interleaved
        self._last: tuple | None = None
        self._seen: set[tuple] = set()
        self._settled: set[tuple] = set()

    def reset(self) -> None:
        """Evaluate every signature's guards again until it settles again."""
        self._last = None
        self._seen.clear()
        self._settled.clear()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        key = signature(args, kwargs)
        if key in self._settled:
            stance = _unguarded()
            if stance is not None:
                self._last = key
                with stance:
                    return self._settled_call(*args, **kwargs)
        before = torch._dynamo.utils.counters["frames"]["total"]
        result = self._compiled(*args, **kwargs)
        repeated = key in self._seen if self._interleaved else key == self._last
        if (
            repeated
            and torch._dynamo.utils.counters["frames"]["total"] == before
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


def compile_static(
    traced: Callable[..., Any],
    distribution: Any,
    *,
    dynamic: bool | None = False,
    **options: Any,
) -> Steady:
    """``traced`` compiled as a region, its guards skipped once settled (``options``:
    :class:`Steady`'s), partitioned with views recomputed in the backward: saving a view
    (a Dense input seen transposed) hides its base, so the partitioner saved relu's
    boolean mask beside it, which inductor's CPU code stores through a slow path (torch
    2.13: twenty times relu itself). Only the plugin's regions get the setting."""
    plain = compiled = torch.compile(traced, dynamic=dynamic)
    with contextlib.suppress(AttributeError, TypeError):  # another torch: as it is
        compiled = torch._functorch.config.patch(recompute_views=True)(plain)
    # Both settings matter only where dynamo compiles: settled calls skip them.
    compiled = cache_key.keyed(compiled, distribution)
    return Steady(compiled, code_of(traced), settled_call=plain, **options)


class Region:
    """``function`` compiled under the distribution of its first call; ``what`` and
    ``then`` word the one warning a compile failure gives; ``options``:
    :func:`compile_static`'s."""

    def __init__(
        self,
        function: Callable[..., Any],
        what: str,
        *,
        qualname: str | None = None,
        then: str = "it runs eagerly from now on.",
        **options: Any,
    ) -> None:
        self._traced = renamed(function, qualname) if qualname else function
        self._options = options
        self._compiled: Steady | None = None
        self.what = what
        self.then = then
        #: Whether torch.compile failed on it: its calls run the eager code.
        self.failed = False

    def compiled(self) -> Steady:
        if self._compiled is None:
            self._compiled = compile_static(
                self._traced, state.model_parallel(), **self._options
            )
        return self._compiled

    def reset(self) -> None:
        """Its guards run again until its calls settle again (a new step)."""
        if self._compiled is not None:
            self._compiled.reset()

    def __call__(self, eager: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        """The compiled call, or ``eager()`` once torch.compile failed on it."""
        if self.failed:
            return eager()
        try:
            return self.compiled()(*args, **kwargs)
        except Exception as error:
            if not failure.compile_failure(error):
                raise
            self.fail(error)
            return eager()

    def fail(self, error: BaseException) -> None:
        """Its calls run the eager code from now on: one warning naming ``error`` (a
        failed region's eager retry can fail it again: no second warning)."""
        if self.failed:
            return
        self.failed = True
        warnings.warn(
            f"keras-dtensor-fix: torch.compile failed on {self.what} "
            f"({first_line(error)}); {self.then}",
            stacklevel=4,
        )


#: Distribution -> key (a class first) -> its region: one per class, as dynamo guards
#: on what its instances share (blocks' and generation's token step).
_BY_CLASS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def of_class(key: tuple, make: Callable[[], Region]) -> Region:
    """The region ``key`` names under this distribution, ``make()``'s at first."""
    regions = _BY_CLASS.setdefault(state.model_parallel(), {})
    if key not in regions:
        regions[key] = make()
    return regions[key]


def reset_all() -> None:
    """Every region's guards run again until its calls settle again (a new step)."""
    for regions in _BY_CLASS.values():
        for found in regions.values():
            found.reset()


def forget() -> None:
    """Drop every region (deactivation)."""
    _BY_CLASS.clear()
