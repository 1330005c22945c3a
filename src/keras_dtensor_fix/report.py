"""The status report: ``keras_dtensor_fix.status()`` (:func:`report`) and
:func:`summarize`, which judges it by cause; read from the engine, never by it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from keras_dtensor_fix import _bootstrap
from keras_dtensor_fix._version import __version__
from keras_dtensor_fix.engine import config as _config
from keras_dtensor_fix.engine import install, patcher, targets
from keras_dtensor_fix.engine.ledger import (
    ANY,
    APPLIED,
    DISABLED,
    EXPECTED,
    PENDING,
    SKIPPED,
    STATES,
)

__all__ = ["problems", "report", "summarize"]


def report() -> dict[str, Any]:
    """``keras_dtensor_fix.status()``: see its docstring."""
    cfg = _config.load(warn=False)
    part = patcher.state()
    keras_version, keras_dist = targets.keras_version()
    warnings = part["warnings"] = list(cfg.warnings) + part["warnings"]
    if len(installed := targets.installed_keras()) > 1:
        names = ", ".join(f"{name} {version}" for name, version in installed)
        warnings.append(f"several Keras distributions are installed ({names})")
    if not part["enabled"] and part["why"] == "not activated":
        booted = _bootstrap.reason != "not booted"
        part["why"] = _bootstrap.reason if booted else cfg.reason
    backend, backend_source = install.configured_backend()
    return {
        "version": __version__,
        "keras": {"version": keras_version, "distribution": keras_dist},
        "configured_backend": {"name": backend, "from": backend_source},
        "problems": problems(),
        "torch": {"version": targets.torch_version()},
        "backend": targets.backend(),
        "layout": targets.layout(),
        **part,
    }


def problems(import_error: str | None = None) -> list[str]:
    """Why a ModelParallel script started now would not get the fix, each
    with what to do; ``import_error``: how importing Keras failed, if it did."""
    backend = install.backend_problem()
    # Another backend's line says what to do; else a failed import says it.
    keras = install.keras_problem()
    if import_error and not backend:
        keras = (
            f"Keras cannot be imported ({import_error}): reinstall it, "
            f"`{install.INSTALL_NIGHTLY}`"
        )
    return [problem for problem in (keras, backend) if problem]


def summarize(
    report: dict[str, Any],
    *,
    exists: Callable[[str], bool] | None = None,
    all_targets: bool = True,
) -> dict[str, Any]:
    """What a person needs from ``report``: state, family counts, the unexpected.

    ``exists``: whether this Keras has a module; ``all_targets``: every existing target
    module was imported (one still pending is news). Keys: ``state`` (active, off, not
    ready, idle, waiting), ``headline``, ``python``, ``families`` (state, a count per
    row state, ``skipped_because``), ``unexpected`` (lines) and ``ok``."""
    import platform

    exists = exists or (lambda name: targets.find_spec(name) is not None)
    gate = report["gate"]
    working = report["enabled"] and gate["ok"] is True
    families: dict[str, dict[str, Any]] = {}
    unexpected: list[str] = []
    for row in report["targets"]:
        state, module, reason = row["state"], row["module"], row["reason"]
        fresh = {**dict.fromkeys(STATES, 0), "skipped_because": {}, "modules": set()}
        family = families.setdefault(row["family"], fresh)
        family[state] = family.get(state, 0) + 1
        if not module.startswith("keras_dtensor_fix."):
            family["modules"].add(module)
        target = module if row["attribute"] == ANY else f"{module}.{row['attribute']}"
        if state == SKIPPED:
            if (word := EXPECTED.get(row["cause"], "unexpected")) == "unexpected":
                unexpected.append(f"{row['family']}: {target} skipped: {reason}")
            because = family["skipped_because"]
            because[word] = because.get(word, 0) + 1
        elif state == PENDING and working and all_targets and exists(module):
            unexpected.append(f"{row['family']}: {target} pending: {reason}")
    disabled = set(report["disabled_families"])
    for name, family in families.items():
        modules = family.pop("modules")
        if family[APPLIED]:
            family["state"] = APPLIED
        elif family[DISABLED] or name in disabled or ANY in disabled:
            family["state"] = DISABLED
        elif family[PENDING]:
            family["state"] = PENDING
        else:  # a family that applied nothing it could is news
            family["state"] = SKIPPED
            present = sorted(m for m in modules if exists(m))
            flagged = any(line.startswith(f"{name}: ") for line in unexpected)
            if working and present and not flagged:
                unexpected.append(
                    f"{name}: nothing applied although this Keras has "
                    f"{', '.join(present)}"
                )
    problems = report.get("problems") or []
    if report["enabled"]:
        unexpected.extend(problems)
        if report["backend"] == "torch" and gate["ok"] is False and not problems:
            unexpected.append(f"gate: {gate['reason']}")
    applied = sum(f[APPLIED] for f in families.values())
    patched = sum(1 for f in families.values() if f[APPLIED])
    if not report["enabled"]:
        state, headline = "off", "OFF: upstream Keras runs unpatched"
    elif problems:
        state, headline = "not ready", f"NOT READY: {problems[0]}"
    elif gate["ok"] is False:
        state, headline = "idle", "IDLE: nothing to patch here"
    elif gate["ok"] is None:
        state, headline = "waiting", "WAITING: nothing patched yet"
    else:
        state = "active"
        groups = f"{patched} group" + ("s" if patched != 1 else "")
        headline = f"ACTIVE: {applied} Keras functions patched ({groups})"
        if not applied:
            headline = "ACTIVE, but nothing is patched"
        if off := [n for n, f in families.items() if f["state"] == DISABLED]:
            headline += f" ({len(off)} disabled: {', '.join(off)})"
    return {
        "state": state,
        "headline": headline,
        "python": platform.python_version(),
        "families": families,
        "unexpected": unexpected,
        "ok": not unexpected,
    }
