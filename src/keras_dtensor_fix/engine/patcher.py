"""The one place that applies and reverts patches.

A target module's import (a post-import hook) has :mod:`.loader` import the family, its
:class:`Implementation` gives :class:`Patch` records, and :mod:`.wrappers` installs
each; :func:`deactivate` puts the originals back. One re-entrant lock (hooks fire inside
hooks). A failure is logged and the patch skipped, unless strict mode
(``KERAS_DTENSOR_FIX_STRICT=1``) raises."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import itertools
import logging
import sys
import threading
import types
from typing import Any

from keras_dtensor_fix.engine import config as _config
from keras_dtensor_fix.engine import hooks, ledger, loader, targets, wrappers
from keras_dtensor_fix.engine import state as _state
from keras_dtensor_fix.engine.contract import Implementation, Patch, resolve
from keras_dtensor_fix.engine.ledger import ANY, Cause
from keras_dtensor_fix.engine.wrappers import (
    chain_length,
    is_fix_wrapper,
    wrapt_problem,
)

__all__ = [
    "Implementation",
    "Patch",
    "PatchError",
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


class PatchError(RuntimeError):
    """A patch could not be applied in strict mode."""


_lock = threading.RLock()
_active = False
_why = "not activated"
_cfg: _config.Config | None = None
_applied: dict[tuple[str, str], wrappers.Applied] = {}
_done: dict[tuple[int, str], loader.Family] = {}  # (id(family), module) applied
_deferred: dict[tuple[int, str], loader.Family] = {}  # waiting for the gate
_warnings: list[str] = []


def _warn(message: str, *, exc_info: bool = False) -> None:
    log.warning(message, exc_info=exc_info)
    _warnings.append(message)


def _fail(message: str, *, trace: bool = True) -> None:
    """A warning (with the exception being handled, if ``trace``), or in strict mode
    an error (inside ``except``: it chains)."""
    if _cfg is not None and _cfg.strict:
        raise PatchError(f"keras_dtensor_fix (strict): {message}")
    _warn(message, exc_info=trace and sys.exc_info()[0] is not None)


def families() -> list[str]:
    """Names of the usable families (real and registered), in order."""
    with _lock:
        return [f.name for f in loader.families() if f.error is None]


def register_family(module: types.ModuleType) -> None:
    """Add a family beside the table's (see :func:`.loader.register`); hooked at once
    if the engine is active."""
    with _lock:
        family = loader.register(module)
        if family is not None and _active and _enabled(family):
            for name in family.modules:
                hooks.ensure(name, _on_import)


def _enabled(family: loader.Family) -> bool:
    return family.error is None and (_cfg is None or _cfg.family_enabled(family.name))


def _on_import(module: types.ModuleType) -> None:
    """Post-import hook: apply the families that target ``module``."""
    try:
        with _lock:
            hooks.fired(module)
            if not _active:
                return
            # Then the modules held back half-imported, now finished.
            for each in itertools.chain([module], hooks.ready(_on_import)):
                for family in filter(_enabled, loader.families()):
                    _apply_to(family, each)
            if _deferred:
                _flush_deferred()
    except PatchError:
        raise  # strict mode: the import fails
    except Exception:  # noqa: BLE001 - never break the user's import
        _warn(f"keras_dtensor_fix: hook for {module!r} failed", exc_info=True)


def _apply_to(family: loader.Family, module: types.ModuleType) -> None:
    if module.__name__ in family.modules:
        _apply_family(family, module)
    elif family.preload and module.__name__ == targets.KERAS:
        _preload(family)


def _flush_deferred() -> None:
    if targets.gate().ok is None:
        return
    for key, family in list(_deferred.items()):
        _deferred.pop(key, None)
        if (module := sys.modules.get(key[1])) is not None:
            _apply_to(family, module)


def _gate_open(family: loader.Family, module: str) -> bool:
    """Whether ``family`` may act on ``module`` now (undecided: deferred); a target
    module gets a row saying why not."""
    key = (id(family), module)
    if family.gated and (verdict := targets.gate()).ok is not True:
        undecided = verdict.ok is None
        if undecided:
            _deferred[key] = family
        if module in family.modules:
            cause = Cause.GATE_UNDECIDED if undecided else Cause.GATE_CLOSED
            ledger.record(family.name, module, ANY, cause, verdict.reason)
        return False
    _deferred.pop(key, None)
    return True


def _preload(family: loader.Family) -> None:
    """Keras is in: import the family's modules, whose hooks apply it now."""
    if not _gate_open(family, targets.KERAS):
        return
    for name in filter(targets.find_spec, family.modules):  # not the other layout's
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - never break the user's import
            _fail(f"family {family.name}: preloading {name} failed")


def _apply_family(family: loader.Family, module: types.ModuleType) -> None:
    name = module.__name__
    if not _gate_open(family, name):
        return
    ledger.forget(family.name, name)
    note = functools.partial(ledger.record, family.name, name, ANY)
    try:
        implementation = loader.implementation(family)
    except Exception:  # noqa: BLE001 - never break the user's import
        implementation = None
        _fail(f"patch family {family.name} ({family.source}) failed to import")
    if implementation is None:
        note(Cause.IMPORT_FAILED, str(family.error))
        return
    try:
        patches = list(implementation.patches(module))
    except LookupError as exc:
        # The family's way of saying "this Keras has no such target": a
        # one-line warning and a status row, no traceback.
        note(Cause.NOT_IN_THIS_KERAS, str(exc))
        _fail(f"family {family.name} skips {name}: {exc}", trace=False)
        return
    except Exception as exc:  # noqa: BLE001
        note(Cause.PATCHES_FAILED, f"{type(exc).__name__}: {exc}")
        _fail(f"family {family.name}: patches({name}) failed")
        return
    if not patches:
        note(Cause.NOTHING_TO_PATCH, "nothing to patch in this Keras")
    for patch in patches:
        try:
            _apply_one(family, patch)
        except PatchError:
            raise
        except Exception as exc:  # noqa: BLE001
            why = f"{type(exc).__name__}: {exc}"
            row = (patch.module, patch.attribute)
            ledger.record(family.name, *row, Cause.PATCH_FAILED, why)
            _fail(f"family {family.name}: patching {patch.attribute} failed")
    key = (id(family), name)
    if key not in _done:
        _done[key] = family
        _call_optional(family, "after_apply")


def _call_optional(family: loader.Family, hook: str) -> None:
    if (function := getattr(family.implementation, hook, None)) is None:
        return
    try:
        function()
    except Exception:  # noqa: BLE001
        _fail(f"family {family.name}: {hook}() failed")


def _apply_one(family: loader.Family, patch: Patch) -> None:
    row = (patch.module, patch.attribute)
    note = functools.partial(ledger.record, family.name, *row)
    module = sys.modules.get(patch.module)
    if module is None:
        note(Cause.MODULE_NOT_IMPORTED, f"module {patch.module} is not imported")
        return
    owner, name = resolve(module, patch.attribute)
    raw, inherited_from = wrappers.stored(owner, name)
    if owner is None or (raw is wrappers.MISSING and not patch.added):
        note(Cause.NOT_FOUND, f"not found: {patch.module}.{patch.attribute}")
        _fail(f"family {family.name}: {patch.module}.{patch.attribute} not found")
        return
    if patch.added and raw is not wrappers.MISSING:
        if row not in _applied or _applied[row].wrapper is not raw:
            note(Cause.NOTHING_TO_PATCH, "has its own: kept")
        return
    if inherited_from is not None:
        base = f"inherited from {inherited_from.__name__}"
        if is_fix_wrapper(raw):
            note(Cause.INHERITED, f"{base}; covered by its patch")
        else:
            note(Cause.INHERITED_UNPATCHED, f"{base}; not patched there")
        return
    if is_fix_wrapper(raw):
        existing = _applied.get(row)
        if existing is None or existing.wrapper is not raw:
            note(Cause.ALREADY_WRAPPED, "already wrapped by another keras_dtensor_fix")
        elif existing.family != family.name:
            note(
                Cause.PATCHED_BY_FAMILY, f"already patched by family {existing.family}"
            )
        return
    record = wrappers.install(family.name, patch, owner, name, raw)
    _applied[row] = record
    also = f" (also in {', '.join(sorted(record.also))})" if record.also else ""
    note(Cause.WRAPPED, "added" if patch.added else f"wrapped{also}")
    log.debug("patched %s.%s", patch.module, patch.attribute)


def _revert_one(record: wrappers.Applied) -> None:
    patch = record.patch
    row = (record.family, patch.module, patch.attribute)
    if wrappers.restore(record):
        ledger.record(*row, Cause.RESTORED, "original restored")
    else:
        _warn(
            f"{patch.module}.{patch.attribute} was replaced after patching; left alone"
        )
        why = "replaced by someone else after patching; not reverted"
        ledger.record(*row, Cause.REPLACED, why)


def activate(
    cfg: _config.Config | None = None,
    *,
    why: str | None = None,
    strict: bool | None = None,
) -> None:
    """Register the post-import hooks and patch what is already imported; ``cfg``
    defaults to :func:`.config.load`, ``strict`` overrides its. Idempotent."""
    global _active, _cfg, _why
    with _lock:
        if (problem := wrapt_problem()) is not None:
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
            # targets it, so a failing family warns once. ``keras`` runs the
            # preloads; it and ``distribution_lib`` decide a deferred gate.
            names = [n for f in filter(_enabled, loader.families()) for n in f.modules]
            names += [targets.KERAS, targets.DISTRIBUTION_LIB]
            for name in dict.fromkeys(names):
                hooks.ensure(name, _on_import)
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
        hooks.forget_held()
        ledger.clear_placeholders()
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


def rows() -> list[dict[str, str]]:
    """One status row per (family, module, attribute), plus placeholders."""
    with _lock:
        return ledger.rows(loader.families(), _cfg, _active)


def state() -> dict[str, Any]:
    """The engine's part of the status report; ``notes``: what the imported families
    say about this Keras build."""
    with _lock:
        families = loader.families()
        disabled = []
        if _cfg is not None:
            disabled = [_config.ALL] if _cfg.disable_all else sorted(_cfg.disabled)
        part = {
            "enabled": _active,
            "why": _why,
            "disabled_families": disabled,
            "gate": dataclasses.asdict(targets.gate()),
            "targets": ledger.rows(families, _cfg, _active),
            "warnings": list(_warnings),
        }
    return {**part, "notes": ledger.notes(families)}
