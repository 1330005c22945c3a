"""The one place that applies and reverts patches.

Patch families (modules in :mod:`keras_dtensor_fix.patches`) describe what to
wrap; the engine wraps it with :class:`wrapt.FunctionWrapper` when the target
module is imported (wrapt post-import hooks), keeps the exact originals, and
puts them back on :func:`deactivate`. Everything runs under one re-entrant
lock, since hooks can fire inside hooks. An exception while patching is logged
and the patch skipped; it never reaches the code that imported Keras.
"""

from __future__ import annotations

import functools
import importlib
import logging
import sys
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import wrapt

from . import config as _config
from . import targets
from .patches import MODULE_OF_FAMILY

__all__ = [
    "ANY",
    "APPLIED",
    "DISABLED",
    "PENDING",
    "REVERTED",
    "SKIPPED",
    "FixWrapper",
    "Patch",
    "activate",
    "chain_length",
    "deactivate",
    "families",
    "is_active",
    "is_fix_wrapper",
    "original",
    "register_family",
    "rows",
    "state",
]

log = logging.getLogger("keras_dtensor_fix")

APPLIED = "applied"
SKIPPED = "skipped"
DISABLED = "disabled"
PENDING = "pending"
REVERTED = "reverted"
#: Attribute (or module) column of a row that stands for a whole module.
ANY = "*"

#: Patch module name -> family name, where the two differ.
_FAMILY_OF_MODULE = {module: family for family, module in MODULE_OF_FAMILY.items()}


@dataclass(frozen=True)
class Patch:
    """One attribute to wrap."""

    family: str  # e.g. "numpy"
    module: str  # module owning the attribute, e.g. "keras.src.backend.torch.ops.numpy"
    attribute: str  # dotted path inside module: "add" or "Adam._parallel_update_step"
    wrapper: Callable[[Any, Any, tuple, dict], Any]  # wrapt wrapper
    also_in: tuple[str, ...] = ()  # modules that bound the same object by name
    # Gated wrappers run only once sharding is on (see ``note_sharding``); until
    # then wrapt calls the original at C speed.
    gated: bool = False
    # A method whose wrapper torch.compile must run too (see ``traced_method``).
    traced: bool = False


#: Non-empty once a sharded (DTensor) distribution is in use in this process.
#: A list, so that wrapt's C code tests it (``enabled=``) without a Python call.
SHARDING: list[bool] = []


def note_sharding() -> None:
    """Open the gated wrappers: DTensors may now meet plain tensors."""
    if not SHARDING:
        SHARDING.append(True)


def sharding() -> bool:
    """Whether the gated wrappers are open."""
    return bool(SHARDING)


class FixWrapper(wrapt.FunctionWrapper):
    """The type of every wrapper the engine installs."""


class FixFunctionWrapper(FixWrapper):
    """A module function's wrapper that torch.compile runs too.

    Dynamo takes a wrapt proxy for the function it wraps and traces the
    original's code, silently skipping the wrapper. It inlines the function an
    object exposes as ``_torchdynamo_inline`` instead: here a plain function
    that calls the wrapper. (Methods keep plain :class:`FixWrapper`: dynamo
    would call that function without ``self``.)
    """

    @property
    def _torchdynamo_inline(self) -> Callable[..., Any]:
        try:
            return self._self_inline
        except AttributeError:
            pass
        wrapper, wrapped = self._self_wrapper, self.__wrapped__

        def inline(*args: Any, **kwargs: Any) -> Any:
            return wrapper(wrapped, None, args, kwargs)

        self._self_inline = inline
        return inline


#: Attribute of a traced method's entry function that holds its FixWrapper.
FIX = "__keras_dtensor_fix__"


def traced_method(fix: FixWrapper) -> Callable[..., Any]:
    """A plain function for the class that runs ``fix``'s wrapper.

    Dynamo traces a method found on a class as a function: given a wrapt proxy
    it traces the original's code and skips the wrapper, and it guards the
    closure of what it inlines, which only a real function has. This entry is
    one, so a compiled step runs the wrapper too. It honours ``enabled=``.
    """
    wrapper, raw, enabled = fix._self_wrapper, fix.__wrapped__, fix._self_enabled

    @functools.wraps(raw)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if enabled is not None and not enabled:
            return raw(self, *args, **kwargs)

        def bound(*inner: Any, **inner_kw: Any) -> Any:
            return raw(self, *inner, **inner_kw)

        return wrapper(bound, self, args, kwargs)

    setattr(method, FIX, fix)
    return method


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
    count = 0
    seen: set[int] = set()
    fix = _fix_of(obj)
    while fix is not None and id(fix) not in seen:
        seen.add(id(fix))
        count += 1
        fix = _fix_of(fix.__wrapped__)
    return count


@dataclass
class _Family:
    name: str
    source: str
    module: types.ModuleType | None = None
    error: str | None = None
    gated: bool = True

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(getattr(self.module, "MODULES", ()))


@dataclass
class _Applied:
    family: str
    patch: Patch
    owner: Any
    name: str
    original: Any
    wrapper: Any  # what is installed: a FixWrapper, or a traced method's entry
    also: set[str] = field(default_factory=set)


_lock = threading.RLock()
_active = False
_why = "not activated"
_cfg: _config.Config | None = None
_families: list[_Family] | None = None
_extra: list[_Family] = []
_registered: set[str] = set()  # module names with a hook not fired yet
_applied: dict[tuple[str, str], _Applied] = {}
_done: dict[tuple[int, str], _Family] = {}  # (id(family), module) after_apply ran
_deferred: dict[tuple[int, str], _Family] = {}  # waiting for the gate to decide
_retry: dict[str, None] = {}  # half-imported at activation: applied at a later hook
_rows: dict[tuple[str, str, str], tuple[str, str]] = {}
_warnings: list[str] = []


def _warn(message: str, *, exc_info: bool = False) -> None:
    log.warning(message, exc_info=exc_info)
    _warnings.append(message)


# -- families ---------------------------------------------------------------


def _check_family(module: types.ModuleType) -> str | None:
    missing = [
        name for name in ("FAMILY", "MODULES", "patches") if not hasattr(module, name)
    ]
    if missing:
        return f"invalid family module: missing {', '.join(missing)}"
    if not callable(module.patches):
        return "invalid family module: patches is not callable"
    return None


def _make_family(module: types.ModuleType, source: str) -> _Family:
    error = _check_family(module)
    name = str(getattr(module, "FAMILY", _FAMILY_OF_MODULE.get(source, source)))
    gated = bool(getattr(module, "GATED", True))
    return _Family(name, source, None if error else module, error, gated)


def _load_families() -> list[_Family]:
    global _families
    if _families is None:
        from .patches import FAMILY_MODULES

        loaded = []
        for source in FAMILY_MODULES:
            fullname = f"{__package__}.patches.{source}"
            fallback = _FAMILY_OF_MODULE.get(source, source)
            try:
                module = importlib.import_module(fullname)
            except ModuleNotFoundError as exc:
                if exc.name != fullname:
                    _warn(f"patch family {fullname} failed to import", exc_info=True)
                    reason = f"import failed: {exc}"
                else:
                    reason = "not implemented"
                loaded.append(_Family(fallback, fullname, error=reason))
                continue
            except Exception as exc:  # noqa: BLE001 - never break the user's import
                _warn(f"patch family {fullname} failed to import", exc_info=True)
                loaded.append(
                    _Family(fallback, fullname, error=f"import failed: {exc}")
                )
                continue
            family = _make_family(module, fullname)
            if family.error is None and family.name not in _config.FAMILIES:
                _warn(
                    f"family {family.name!r} ({fullname}) is not in "
                    "config.FAMILIES: KERAS_DTENSOR_FIX_DISABLE cannot name it"
                )
            loaded.append(family)
        _families = loaded
    return _families + _extra


def families() -> list[str]:
    """Names of the usable families (real and registered), in order."""
    with _lock:
        return [f.name for f in _load_families() if f.error is None]


def register_family(module: types.ModuleType) -> None:
    """Add a family module beside those in ``patches.FAMILY_MODULES``.

    It needs ``FAMILY``, ``MODULES`` and ``patches(module)``; optional are
    ``after_apply()``, ``after_revert()`` and ``GATED`` (default ``True``:
    apply only under Keras's torch backend with distribution support). If the
    engine is active, its hooks are registered at once.
    """
    family = _make_family(module, getattr(module, "__name__", repr(module)))
    if family.error:
        raise TypeError(f"{family.source}: {family.error}")
    with _lock:
        if any(f.module is module for f in _extra):
            return
        _extra.append(family)
        if _active:
            _hook_family(family)


# -- hooks --------------------------------------------------------------------


def _enabled(family: _Family) -> bool:
    return family.error is None and (_cfg is None or _cfg.family_enabled(family.name))


def _ensure_hook(name: str) -> None:
    module = sys.modules.get(name)
    if module is not None:
        if targets._initializing(module):
            # Activated while this module is still being imported (from
            # another post-import hook): its body may be half run, and wrapt
            # would fire a hook at once. Retry at the next hook instead.
            _retry[name] = None
            return
        _on_import(module)
    elif name not in _registered:
        _registered.add(name)
        wrapt.register_post_import_hook(_on_import, name)


def _hook_family(family: _Family) -> None:
    if _enabled(family):
        for name in family.modules:
            _ensure_hook(name)


def _on_import(module: types.ModuleType) -> None:
    """Post-import hook: apply the families that target ``module``."""
    try:
        with _lock:
            name = module.__name__
            if sys.modules.get(name) is module:
                _registered.discard(name)
            if not _active:
                return
            _apply_module(module)
            for pending in list(_retry):
                other = sys.modules.get(pending)
                if other is None or not targets._initializing(other):
                    _retry.pop(pending, None)
                    if other is not None:
                        _apply_module(other)
                    else:
                        _ensure_hook(pending)
            if _deferred:
                _flush_deferred()
    except Exception:  # noqa: BLE001 - never break the user's import
        _warn(f"keras_dtensor_fix: hook for {module!r} failed", exc_info=True)


def _apply_module(module: types.ModuleType) -> None:
    for family in _load_families():
        if _enabled(family) and module.__name__ in family.modules:
            _apply_family(family, module)


def _flush_deferred() -> None:
    if targets.gate().ok is None:
        return
    for key, family in list(_deferred.items()):
        _deferred.pop(key, None)
        module = sys.modules.get(key[1])
        if module is not None:
            _apply_family(family, module)


# -- apply / revert -------------------------------------------------------------


def _set_row(family: str, module: str, attribute: str, state: str, why: str) -> None:
    _rows[(family, module, attribute)] = (state, why)


def _resolve(module: types.ModuleType, attribute: str) -> tuple[Any, str]:
    *path, name = attribute.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


_MISSING = object()


def _raw(owner: Any, name: str) -> tuple[Any, type | None]:
    """The object stored under ``name`` and, if inherited, the class owning it."""
    if isinstance(owner, type):
        if name in owner.__dict__:
            return owner.__dict__[name], None
        for klass in owner.__mro__[1:]:
            if name in klass.__dict__:
                return klass.__dict__[name], klass
        return _MISSING, None
    return getattr(owner, name, _MISSING), None


def _apply_family(family: _Family, module: types.ModuleType) -> None:
    name = module.__name__
    key = (id(family), name)
    if family.gated:
        verdict = targets.gate()
        if verdict.ok is None:
            _deferred[key] = family
            _set_row(family.name, name, ANY, PENDING, verdict.reason)
            return
        if not verdict.ok:
            _set_row(family.name, name, ANY, SKIPPED, verdict.reason)
            return
    _deferred.pop(key, None)
    _rows.pop((family.name, name, ANY), None)
    try:
        patches = list(family.module.patches(module))
    except LookupError as exc:
        # The family's way of saying "this Keras has no such target": a
        # one-line warning and a status row, no traceback.
        _warn(f"keras_dtensor_fix: family {family.name} skips {name}: {exc}")
        _set_row(family.name, name, ANY, SKIPPED, str(exc))
        return
    except Exception as exc:  # noqa: BLE001
        _warn(f"family {family.name}: patches({name}) failed", exc_info=True)
        _set_row(family.name, name, ANY, SKIPPED, f"{type(exc).__name__}: {exc}")
        return
    for patch in patches:
        try:
            _apply_one(family, patch)
        except Exception as exc:  # noqa: BLE001
            _warn(
                f"family {family.name}: patching {patch.attribute} failed",
                exc_info=True,
            )
            _set_row(
                family.name,
                patch.module,
                patch.attribute,
                SKIPPED,
                f"{type(exc).__name__}: {exc}",
            )
    if key not in _done:
        _done[key] = family
        _call_optional(family, "after_apply")


def _call_optional(family: _Family, hook: str) -> None:
    function = getattr(family.module, hook, None)
    if function is None:
        return
    try:
        function()
    except Exception:  # noqa: BLE001
        _warn(f"family {family.name}: {hook}() failed", exc_info=True)


def _apply_one(family: _Family, patch: Patch) -> None:
    row = (family.name, patch.module, patch.attribute)
    module = sys.modules.get(patch.module)
    if module is None:
        _set_row(*row, SKIPPED, f"module {patch.module} is not imported")
        return
    try:
        owner, name = _resolve(module, patch.attribute)
    except AttributeError as exc:
        _set_row(*row, SKIPPED, f"not found: {exc}")
        return
    raw, inherited_from = _raw(owner, name)
    if raw is _MISSING:
        _set_row(*row, SKIPPED, f"not found: {patch.module}.{patch.attribute}")
        return
    if inherited_from is not None:
        covered = is_fix_wrapper(raw)
        tail = "covered by its patch" if covered else "not patched there"
        _set_row(*row, SKIPPED, f"inherited from {inherited_from.__name__}; {tail}")
        return
    key = (patch.module, patch.attribute)
    if is_fix_wrapper(raw):
        existing = _applied.get(key)
        if existing is not None and existing.wrapper is raw:
            if existing.family != family.name:
                _set_row(*row, SKIPPED, f"already patched by family {existing.family}")
        else:
            _set_row(*row, SKIPPED, "already wrapped by another keras_dtensor_fix")
        return
    # A method's plain wrapper runs in eager code only: dynamo inlines the
    # original method. ``traced`` installs a real function that dynamo runs.
    kind = FixWrapper if isinstance(owner, type) else FixFunctionWrapper
    wrapper = kind(raw, patch.wrapper, enabled=SHARDING if patch.gated else None)
    if patch.traced and isinstance(owner, type) and isinstance(raw, types.FunctionType):
        wrapper = traced_method(wrapper)
    setattr(owner, name, wrapper)
    record = _Applied(family.name, patch, owner, name, raw, wrapper)
    _applied[key] = record
    for other in patch.also_in:
        _patch_also(record, other)
    also = f" (also in {', '.join(sorted(record.also))})" if record.also else ""
    _set_row(*row, APPLIED, f"wrapped{also}")
    log.debug("patched %s.%s", patch.module, patch.attribute)


def _also_owner(record: _Applied, module_name: str) -> Any:
    module = sys.modules.get(module_name)
    if module is None:
        return None
    try:
        owner, _ = _resolve(module, record.patch.attribute)
    except AttributeError:
        return None
    return None if owner is record.owner else owner


def _patch_also(record: _Applied, module_name: str) -> None:
    owner = _also_owner(record, module_name)
    if owner is not None and _raw(owner, record.name)[0] is record.original:
        setattr(owner, record.name, record.wrapper)
        record.also.add(module_name)


def _revert_one(record: _Applied) -> None:
    patch = record.patch
    row = (record.family, patch.module, patch.attribute)
    if _raw(record.owner, record.name)[0] is record.wrapper:
        setattr(record.owner, record.name, record.original)
        _set_row(*row, REVERTED, "original restored")
    else:
        _warn(
            f"{patch.module}.{patch.attribute} was replaced after patching; left alone"
        )
        _set_row(*row, SKIPPED, "replaced by someone else after patching; not reverted")
    for module_name in set(patch.also_in) | record.also:
        owner = _also_owner(record, module_name)
        if owner is not None and _raw(owner, record.name)[0] is record.wrapper:
            setattr(owner, record.name, record.original)


# -- public switches --------------------------------------------------------------

#: The wrapt the engine is written for; older ones lack what it uses.
WRAPT_MAJOR = 2
_WRAPT_NEEDS = ("register_post_import_hook",)


def wrapt_problem() -> str | None:
    """Why the installed wrapt cannot run the engine (one line), or ``None``."""
    version = str(getattr(wrapt, "__version__", "unknown"))
    missing = [name for name in _WRAPT_NEEDS if not hasattr(wrapt, name)]
    try:
        too_old = int(version.split(".")[0]) < WRAPT_MAJOR
    except ValueError:
        too_old = False
    if not too_old and not missing:
        return None
    lacking = f" without {', '.join(missing)}" if missing else ""
    return (
        f"keras-dtensor-fix needs wrapt>={WRAPT_MAJOR} (found {version}{lacking}); "
        "not activated"
    )


def activate(cfg: _config.Config | None = None, *, why: str | None = None) -> None:
    """Register the post-import hooks and patch what is already imported.

    ``cfg`` defaults to :func:`keras_dtensor_fix.config.load` (its disable list
    applies; its on/off switch is for automatic activation only). Idempotent.
    """
    global _active, _cfg, _why
    with _lock:
        problem = wrapt_problem()
        if problem is not None:
            _why = problem
            if problem not in _warnings:
                _warn(problem)
            return
        _cfg = cfg if cfg is not None else _config.load()
        _why = why or "activated by activate()"
        if _active:
            return
        _active = True
        try:
            # Each module once: a module hook applies every family that
            # targets it, so a failing family warns once.
            names = dict.fromkeys(
                name
                for family in _load_families()
                if _enabled(family)
                for name in family.modules
            )
            names.update(dict.fromkeys(("keras", targets.DISTRIBUTION_LIB)))
            for name in names:
                _ensure_hook(name)
        except Exception:  # noqa: BLE001 - never break the caller
            _warn("keras_dtensor_fix: activation failed part way", exc_info=True)


def deactivate() -> None:
    """Restore every original object (identity) and stop acting on imports."""
    global _active, _why
    with _lock:
        _why = "deactivated by deactivate()"
        if not _active:
            return
        _active = False
        for record in reversed(list(_applied.values())):
            try:
                _revert_one(record)
            except Exception:  # noqa: BLE001
                _warn(f"reverting {record.patch.attribute} failed", exc_info=True)
        _applied.clear()
        _deferred.clear()
        _retry.clear()
        for key in [k for k in _rows if k[2] == ANY]:
            del _rows[key]
        done = list(_done.values())
        _done.clear()
        for family in done:
            _call_optional(family, "after_revert")


def is_active() -> bool:
    """Whether the engine is active."""
    return _active


def original(module: str, attribute: str) -> Any:
    """The original object behind an applied patch, or ``None``."""
    with _lock:
        record = _applied.get((module, attribute))
        return None if record is None else record.original


def _row(family: str, module: str, attribute: str, state: str, why: str) -> dict:
    return {
        "family": family,
        "module": module,
        "attribute": attribute,
        "state": state,
        "reason": why,
    }


def rows() -> list[dict[str, str]]:
    """One status row per (family, module, attribute), plus placeholders.

    A module that is not imported yet gets one ``pending`` row with attribute
    ``"*"``; so does a whole module that was skipped (gate, ``patches()``
    error) or disabled.
    """
    with _lock:
        cfg = _cfg if _cfg is not None else _config.load(warn=False)
        verdict = targets.gate()
        out: list[dict[str, str]] = []
        for family in _load_families():
            if family.error is not None:
                out.append(_row(family.name, family.source, ANY, SKIPPED, family.error))
                continue
            recorded = [k for k in _rows if k[0] == family.name]
            modules = list(family.modules)
            modules += [m for _, m, _ in recorded if m not in modules]
            for module in modules:
                keys = [k for k in recorded if k[1] == module]
                if keys:
                    out.extend(_row(*k, *_rows[k]) for k in keys)
                elif not cfg.family_enabled(family.name):
                    why = f"disabled by {_config.ENV_DISABLE}"
                    out.append(_row(family.name, module, ANY, DISABLED, why))
                elif not _active:
                    why = "keras_dtensor_fix is not active"
                    out.append(_row(family.name, module, ANY, PENDING, why))
                elif family.gated and verdict.ok is False:
                    out.append(_row(family.name, module, ANY, SKIPPED, verdict.reason))
                elif "keras" in sys.modules and targets.find_spec(module) is None:
                    why = f"no such module in this Keras (layout {targets.layout()})"
                    out.append(_row(family.name, module, ANY, SKIPPED, why))
                else:
                    why = "module not imported yet"
                    out.append(_row(family.name, module, ANY, PENDING, why))
        return out


def _disabled_names() -> list[str]:
    if _cfg is None:
        return []
    return [_config.ALL] if _cfg.disable_all else sorted(_cfg.disabled)


def state() -> dict[str, Any]:
    """The engine's own part of the status report."""
    with _lock:
        verdict = targets.gate()
        return {
            "active": _active,
            "why": _why,
            "disabled_families": _disabled_names(),
            "gate": {"ok": verdict.ok, "reason": verdict.reason},
            "targets": rows(),
            "warnings": list(_warnings),
        }
