"""One compiled piece of a step: what every function the plugin compiles shares.

A block, the tail, the update per block and generation's token step each run through a
:class:`Region`: ``torch.compile`` with static shapes (DTensor fails on symbolic sizes:
torch 2.13, pytorch/pytorch#152963), the per-process cache tag (:mod:`.cache_key`),
views recomputed in the backward, guards skipped once settled (:class:`.steady.Steady`),
a code object of its own (dynamo counts cache entries per code object) and, where
torch.compile fails (:mod:`.failure`), one warning and the eager code from then on."""

from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

from keras_dtensor_fix.compiled import cache_key, failure
from keras_dtensor_fix.compiled.steady import Steady, code_of
from keras_dtensor_fix.engine import state, targets

__all__ = [
    "SCOPELESS",
    "Region",
    "compile_static",
    "eligible",
    "name_scope",
    "renamed",
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


def compile_static(
    traced: Callable[..., Any],
    distribution: Any,
    *,
    interleaved: bool = False,
    fixed: int = 0,
    dynamic: bool | None = False,
) -> Steady:
    """``traced`` compiled as a region, its guards skipped once settled."""
    plain = torch.compile(traced, dynamic=dynamic)
    # The two settings matter only where dynamo compiles: settled calls,
    # which cannot, skip setting them around each call.
    compiled = cache_key.keyed(_views_recomputed(plain), distribution)
    return Steady(
        compiled,
        code_of(traced),
        interleaved=interleaved,
        settled_call=plain,
        fixed=fixed,
    )


def _views_recomputed(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` partitioned with views recomputed in the backward.

    Saving a view (a Dense input seen transposed) hides its base, so the partitioner
    saved relu's boolean mask beside it, which inductor's CPU code stores through a slow
    path (torch 2.13: twenty times relu itself). Only the plugin's regions get the
    setting."""
    try:
        patch = torch._functorch.config.patch(recompute_views=True)
    except (AttributeError, TypeError):  # another torch: as it partitions
        return compiled
    return patch(compiled)


class Region:
    """``function`` compiled under the distribution of its first call; ``what`` and
    ``then`` word the one warning a compile failure gives."""

    def __init__(
        self,
        function: Callable[..., Any],
        what: str,
        *,
        qualname: str | None = None,
        then: str = "it runs eagerly from now on.",
        interleaved: bool = False,
        fixed: int = 0,
        dynamic: bool | None = False,
    ) -> None:
        self._traced = renamed(function, qualname) if qualname else function
        self._options = {"interleaved": interleaved, "fixed": fixed, "dynamic": dynamic}
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
            self.failed = True
            warnings.warn(
                f"keras-dtensor-fix: torch.compile failed on {self.what} "
                f"({failure.cause(error)}); {self.then}",
                stacklevel=3,
            )
            return eager()
