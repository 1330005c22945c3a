"""The one place that applies and reverts patches.

The families are the rows of :mod:`keras_dtensor_fix.families`. When one of
a family's target modules is imported (a wrapt post-import hook), the engine
imports the family's implementation, asks its :class:`Implementation` for
:class:`Patch` records, wraps each attribute with a :class:`FixWrapper`, keeps
the exact original and puts it back on :func:`deactivate` (which also undoes
what the families set on Keras objects, see :mod:`keras_dtensor_fix.state`).
Everything runs under one re-entrant lock, since hooks can fire inside hooks.
An exception while patching is logged and the patch skipped: it never reaches
the code that imported Keras, unless strict mode is on
(``KERAS_DTENSOR_FIX_STRICT=1`` or ``activate(strict=True)``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import sys
import threading
import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import wrapt

from . import config as _config
from . import families as _table
from . import state as _state
from . import targets

__all__ = [
    "ANY",
    "APPLIED",
    "DISABLED",
    "PENDING",
    "REVERTED",
    "SKIPPED",
    "FixWrapper",
    "Implementation",
    "Patch",
    "PatchError",
    "activate",
    "chain_length",
    "deactivate",
    "families",
    "is_active",
    "is_fix_wrapper",
    "notes",
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


class PatchError(RuntimeError):
    """A patch could not be applied in strict mode."""


@dataclass(frozen=True)
class Patch:
    """One attribute to wrap."""

    module: str  # module owning the attribute, e.g. targets.modules("numpy")[0]
    attribute: str  # dotted path inside module: "add" or "Adam._parallel_update_step"
    wrapper: Callable[[Any, Any, tuple, dict], Any]  # wrapt wrapper
    also_in: tuple[str, ...] = ()  # modules that bound the same object by name
    # Gated wrappers run only once sharding is on (``state.note_sharding``);
    # until then wrapt calls the original at C speed.
    gated: bool = False
    # A method whose wrapper torch.compile must run too (see ``traced_method``).
    traced: bool = False


@dataclass(frozen=True)
class Implementation:
    """What a family's implementation module exports as ``IMPLEMENTATION``.

    ``patches(module)`` lists the patches for one imported target module
    (raising :class:`LookupError` means "this Keras has no such target": a
    one-line warning and a status row). ``after_apply`` runs once per target
    module after its patches, ``after_revert`` once after deactivation, and
    ``notes`` says what the family found about this Keras build (``status``).
    """

    patches: Callable[[types.ModuleType], Iterable[Patch]]
    after_apply: Callable[[], None] | None = None
    after_revert: Callable[[], None] | None = None
    notes: Callable[[], list[str]] | None = None


#: The gate of every gated wrapper (``wrapt``'s ``enabled=``).
SHARDING = _state.SHARDING


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
    modules: tuple[str, ...]
    source: str  # the implementation's module name
    gated: bool = True
    implementation: Implementation | None = None
    error: str | None = None  # why the implementation is unusable


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


def _strict() -> bool:
    return _cfg is not None and _cfg.strict


def _fail(message: str) -> None:
    """A patch that cannot apply: a warning, or in strict mode an error.

    Call it inside ``except`` to keep the traceback (strict mode chains it).
    """
    if _strict():
        raise PatchError(f"keras_dtensor_fix (strict): {message}")
    _warn(message, exc_info=sys.exc_info()[0] is not None)


# -- families ---------------------------------------------------------------

#: Package of the families' implementation modules.
PATCHES = f"{__package__}.patches"


def _from_row(row: _table.Family) -> _Family:
    modules = tuple(
        dict.fromkeys(name for kind in row.kinds for name in targets.modules(kind))
    )
    return _Family(row.name, modules, f"{PATCHES}.{row.implementation}", row.gated)


def _load_families() -> list[_Family]:
    """The table's families (implementations not imported yet), then registered."""
    global _families
    if _families is None:
        _families = [_from_row(row) for row in _table.FAMILIES]
    return _families + _extra


def _check_implementation(found: object, source: str) -> Implementation:
    if not isinstance(found, Implementation):
        raise TypeError(
            f"{source}.IMPLEMENTATION is {type(found).__name__}, not "
            "keras_dtensor_fix.engine.Implementation"
        )
    return found


def _implementation(family: _Family) -> Implementation | None:
    """The family's implementation, imported on first use; None if unusable."""
    if family.implementation is None and family.error is None:
        try:
            module = importlib.import_module(family.source)
            family.implementation = _check_implementation(
                getattr(module, "IMPLEMENTATION", None), family.source
            )
        except Exception as exc:  # noqa: BLE001 - never break the user's import
            family.error = f"import failed: {type(exc).__name__}: {exc}"
            _fail(f"patch family {family.name} ({family.source}) failed to import")
    return family.implementation


def families() -> list[str]:
    """Names of the usable families (real and registered), in order."""
    with _lock:
        return [f.name for f in _load_families() if f.error is None]


def notes() -> list[str]:
    """What the imported family implementations say about this Keras build."""
    found: list[str] = []
    with _lock:
        loaded = [f for f in _load_families() if f.implementation is not None]
    for family in loaded:
        function = family.implementation.notes
        if function is None:
            continue
        try:
            found.extend(function())
        except Exception as exc:  # noqa: BLE001 - a report must not fail
            found.append(f"{family.name}: notes unavailable ({exc})")
    return found


def register_family(
    family: types.ModuleType | _table.Family,
    implementation: Implementation | None = None,
) -> None:
    """Add a family beside the table's (a plugin of the plugin, or a test fake).

    Either a row of the table's kind and its :class:`Implementation`, or a
    module with ``FAMILY``, ``MODULES`` (module names), ``patches(module)`` and
    optionally ``after_apply``, ``after_revert``, ``notes`` and ``GATED``. If
    the engine is active, its hooks are registered at once.
    """
    if isinstance(family, _table.Family):
        record = _from_row(family)
        record.implementation = _check_implementation(implementation, family.name)
        key: object = implementation
    else:
        missing = [
            n for n in ("FAMILY", "MODULES", "patches") if not hasattr(family, n)
        ]
        if missing or not callable(getattr(family, "patches", None)):
            what = (
                f"missing {', '.join(missing)}" if missing else "patches not callable"
            )
            raise TypeError(f"{family!r}: invalid family module: {what}")
        record = _Family(
            str(family.FAMILY),
            tuple(family.MODULES),
            family.__name__,
            bool(getattr(family, "GATED", True)),
            Implementation(
                family.patches,
                getattr(family, "after_apply", None),
                getattr(family, "after_revert", None),
                getattr(family, "notes", None),
            ),
        )
        key = family
    with _lock:
        if any(getattr(f, "_key", None) is key for f in _extra):
            return
        record._key = key  # type: ignore[attr-defined]
        _extra.append(record)
        if _active:
            _hook_family(record)


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
    except PatchError:
        raise  # strict mode: the import fails
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
    implementation = _implementation(family)
    if implementation is None:
        _set_row(family.name, name, ANY, SKIPPED, str(family.error))
        return
    try:
        patches = list(implementation.patches(module))
    except LookupError as exc:
        # The family's way of saying "this Keras has no such target": a
        # one-line warning and a status row, no traceback.
        _set_row(family.name, name, ANY, SKIPPED, str(exc))
        if _strict():
            raise PatchError(f"family {family.name} skips {name}: {exc}") from exc
        _warn(f"keras_dtensor_fix: family {family.name} skips {name}: {exc}")
        return
    except Exception as exc:  # noqa: BLE001
        _set_row(family.name, name, ANY, SKIPPED, f"{type(exc).__name__}: {exc}")
        _fail(f"family {family.name}: patches({name}) failed")
        return
    if not patches:
        _set_row(family.name, name, ANY, SKIPPED, "nothing to patch in this Keras")
    for patch in patches:
        try:
            _apply_one(family, patch)
        except PatchError:
            raise
        except Exception as exc:  # noqa: BLE001
            _set_row(
                family.name,
                patch.module,
                patch.attribute,
                SKIPPED,
                f"{type(exc).__name__}: {exc}",
            )
            _fail(f"family {family.name}: patching {patch.attribute} failed")
    if key not in _done:
        _done[key] = family
        _call_optional(family, "after_apply")


def _call_optional(family: _Family, hook: str) -> None:
    implementation = family.implementation
    function = getattr(implementation, hook, None) if implementation else None
    if function is None:
        return
    try:
        function()
    except Exception:  # noqa: BLE001
        _fail(f"family {family.name}: {hook}() failed")


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
        _fail(f"family {family.name}: {patch.module}.{patch.attribute} not found")
        return
    raw, inherited_from = _raw(owner, name)
    if raw is _MISSING:
        _set_row(*row, SKIPPED, f"not found: {patch.module}.{patch.attribute}")
        _fail(f"family {family.name}: {patch.module}.{patch.attribute} not found")
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


def activate(
    cfg: _config.Config | None = None,
    *,
    why: str | None = None,
    strict: bool | None = None,
) -> None:
    """Register the post-import hooks and patch what is already imported.

    ``cfg`` defaults to :func:`keras_dtensor_fix.config.load` (its disable list
    and strict switch apply; its on/off switch is for automatic activation
    only). ``strict`` overrides the configuration's. Idempotent.
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
        if strict is not None and strict != _cfg.strict:
            _cfg = dataclasses.replace(_cfg, strict=strict)
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
        except PatchError:
            raise
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
            except Exception:  # noqa: BLE001 - revert the rest
                _warn(f"reverting {record.patch.attribute} failed", exc_info=True)
        _applied.clear()
        _state.undo_attributes()
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
