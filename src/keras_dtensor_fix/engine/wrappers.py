"""The wrappers the engine installs, and installing or removing one by identity.

A gated patch's wrapper has ``enabled=state.SHARDING``, a list wrapt tests in C: without
a sharded distribution the original runs with no Python frame. Every entry dynamo can
meet tests the gate itself and is never a frame of its own (:func:`not_a_frame`). Gated
patches are installed up front, so the status report does not depend on when sharding
starts."""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import wrapt

from keras_dtensor_fix.engine import state
from keras_dtensor_fix.engine.contract import Patch, resolve

__all__ = [
    "MISSING",
    "Applied",
    "FixWrapper",
    "chain_length",
    "install",
    "is_fix_wrapper",
    "not_a_frame",
    "restore",
    "stored",
    "wrapt_problem",
]


class FixWrapper(wrapt.FunctionWrapper):
    """The type of every wrapper the engine installs."""


class FixFunctionWrapper(FixWrapper):
    """A module function's wrapper that torch.compile runs too: dynamo skips a wrapt
    proxy but inlines ``_torchdynamo_inline``, a function calling the wrapper."""

    @property
    def _torchdynamo_inline(self) -> Callable[..., Any]:
        if (cached := getattr(self, "_self_inline", None)) is not None:
            return cached
        wrapper, wrapped = self._self_wrapper, self.__wrapped__
        enabled = self._self_enabled
        local = state.LOCAL_CALL if getattr(self, "_self_traced", False) else ()

        def inline(*args: Any, **kwargs: Any) -> Any:
            # The gate wrapt tests in C for eager calls, tested here for
            # dynamo: closed, a compiled step traces exactly the original
            # (but in a local call, for a ``traced`` patch).
            if enabled is not None and not enabled and not local:
                return wrapped(*args, **kwargs)
            return wrapper(wrapped, None, args, kwargs)

        self._self_inline = inline
        not_a_frame(inline.__code__)
        return inline


#: Attribute of a traced method's entry function that holds its FixWrapper.
FIX = "__keras_dtensor_fix__"


def traced_method(fix: FixWrapper, inline: bool = False) -> Callable[..., Any]:
    """A plain function for the class that runs ``fix``'s wrapper.

    Dynamo traces a method found on a class as a function and guards its closure, which
    only a real function has. With ``inline`` (methods not ``traced``) dynamo is pointed
    at the original: a ``Layer.__call__`` wrapper at every nesting level ran it out of
    recursion depth (torch 2.13)."""
    wrapper, raw, enabled = fix._self_wrapper, fix.__wrapped__, fix._self_enabled

    @functools.wraps(raw)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if enabled is not None and not enabled:
            return raw(self, *args, **kwargs)
        if inline:
            # Eager only: a bound method, which keeps the original's name and
            # module (wrappers read them), as wrapt hands over.
            return wrapper(types.MethodType(raw, self), self, args, kwargs)

        def bound(*inner: Any, **inner_kw: Any) -> Any:
            return raw(self, *inner, **inner_kw)

        return wrapper(bound, self, args, kwargs)

    setattr(method, FIX, fix)
    not_a_frame(method.__code__)
    if inline:
        method._torchdynamo_inline = raw  # type: ignore[attr-defined]
    return method


def not_a_frame(code: types.CodeType) -> None:
    """Dynamo never compiles a frame of ``code`` on its own, still inlines it: after a
    graph break each entry of ours would be one frame more than upstream."""
    if code in _NOT_FRAMES:
        return
    _NOT_FRAMES.add(code)
    # When dynamo is imported (at once if it is): a torch-only patch (torchrun's
    # agent) must not import it.
    wrapt.register_post_import_hook(
        lambda module: module.skip_code(code), "torch._dynamo.eval_frame"
    )


#: The code objects :func:`not_a_frame` was given (every entry shares a few).
_NOT_FRAMES: set[types.CodeType] = set()


def _fix_of(obj: object) -> FixWrapper | None:
    if isinstance(obj, FixWrapper):
        return obj
    fix = getattr(obj, FIX, None) if isinstance(obj, types.FunctionType) else None
    return fix if isinstance(fix, FixWrapper) else None


def is_fix_wrapper(obj: object) -> bool:
    """Whether ``obj`` is a wrapper installed by this engine."""
    return _fix_of(obj) is not None


def chain_length(obj: object) -> int:
    """How many engine wrappers are stacked on ``obj`` (0 when unpatched)."""
    count, fix = 0, _fix_of(obj)
    while fix is not None:
        count += 1
        fix = _fix_of(fix.__wrapped__)
    return count


#: What :func:`stored` finds where there is nothing.
MISSING = object()


def stored(owner: Any, name: str) -> tuple[Any, type | None]:
    """The object stored under ``name`` and, if inherited, the class owning it."""
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if name in klass.__dict__:
                return klass.__dict__[name], None if klass is owner else klass
        return MISSING, None
    return getattr(owner, name, MISSING), None


@dataclass
class Applied:
    """One installed wrapper: everything needed to take it out again."""

    family: str
    patch: Patch
    owner: Any
    name: str
    original: Any
    wrapper: Any  # what is installed: a FixWrapper, or a traced method's entry
    also: set[str] = field(default_factory=set)  # also_in modules rebound


def install(family: str, patch: Patch, owner: Any, name: str, raw: Any) -> Applied:
    """Wrap ``raw`` (``owner.name``), install it there and in ``also_in``
    (an ``added`` patch installs its ``wrapper`` as it is, ``raw`` MISSING)."""
    if patch.added:
        setattr(owner, name, patch.wrapper)
        return Applied(family, patch, owner, name, MISSING, patch.wrapper)
    # A method on a class is always installed as a real function: dynamo
    # reads a method's code and guards its closure, and a wrapt proxy there
    # fails its own guard ("ClosureGuardAccessor: Not a function") on a method
    # that uses ``super()``. ``traced`` runs the wrapper in compiled code too;
    # otherwise dynamo traces the original (``_torchdynamo_inline``).
    kind = FixWrapper if isinstance(owner, type) else FixFunctionWrapper
    wrapper = kind(raw, patch.wrapper, enabled=state.SHARDING if patch.gated else None)
    if patch.traced and kind is FixFunctionWrapper:
        wrapper._self_traced = True
    if isinstance(owner, type) and isinstance(raw, types.FunctionType):
        wrapper = traced_method(wrapper, inline=not patch.traced)
    setattr(owner, name, wrapper)
    record = Applied(family, patch, owner, name, raw, wrapper)
    record.also = _rebind(record, raw, wrapper)
    return record


def _rebind(record: Applied, old: Any, new: Any) -> set[str]:
    """Put ``new`` where an ``also_in`` module holds ``old``; the modules changed."""
    changed = set()
    for module_name in record.patch.also_in:
        owner, _ = resolve(sys.modules.get(module_name), record.patch.attribute)
        if owner is not record.owner and stored(owner, record.name)[0] is old:
            setattr(owner, record.name, new)
            changed.add(module_name)
    return changed


def restore(record: Applied) -> bool:
    """Put the original back wherever ``record``'s wrapper still is; False when the
    owner holds something else now (left alone)."""
    ours = stored(record.owner, record.name)[0] is record.wrapper
    if ours and record.original is MISSING:
        delattr(record.owner, record.name)
    elif ours:
        setattr(record.owner, record.name, record.original)
    _rebind(record, record.wrapper, record.original)
    return ours


#: The wrapt these wrappers are written for; older ones lack what it uses.
WRAPT_MAJOR = 2


def wrapt_problem() -> str | None:
    """Why the installed wrapt cannot run the engine (one line), or ``None``."""
    version = str(getattr(wrapt, "__version__", "unknown"))
    major = version.split(".")[0]
    hook = hasattr(wrapt, "register_post_import_hook")
    if hook and not (major.isdigit() and int(major) < WRAPT_MAJOR):
        return None
    lacking = "" if hook else " without register_post_import_hook"
    return (
        f"keras-dtensor-fix needs wrapt>={WRAPT_MAJOR} (found {version}{lacking}); "
        "not activated"
    )
