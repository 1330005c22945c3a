"""``python -m keras_dtensor_fix status [--verbose|--json] [--check]``, ``demo``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

import keras_dtensor_fix


def _load_keras(all_targets: bool) -> list[str]:
    """Import Keras as the environment selects it; return notes on failures."""
    notes = []
    try:
        importlib.import_module("keras")
    except Exception as exc:  # noqa: BLE001 - report, never fail
        notes.append(f"import keras failed: {type(exc).__name__}: {exc}")
        return notes
    if not all_targets:
        return notes
    from keras_dtensor_fix import engine, targets

    if targets.gate().ok:
        for row in engine.rows():
            module = row["module"]
            if row["state"] == engine.PENDING and targets.find_spec(module):
                try:
                    importlib.import_module(module)
                except Exception as exc:  # noqa: BLE001
                    notes.append(f"import {module} failed: {exc}")
    return notes


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) for cell, width in zip(row[:-1], widths, strict=True)
        ]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The full status report as text: the header and one row per target."""
    keras = report["keras"]
    keras_text = (
        f"{keras['distribution']} {keras['version']}" if keras["version"] else "missing"
    )
    gate = report["gate"]
    state = "active" if report["enabled"] else "inactive"
    head = [
        ["keras-dtensor-fix", report["version"]],
        ["Keras", keras_text],
        ["torch", report["torch"]["version"] or "missing"],
        ["backend", str(report["backend"])],
        ["layout", str(report["layout"])],
        ["fix", f"{state}: {report['why']}"],
        ["gate", f"{gate['ok']}: {gate['reason']}"],
        ["disabled", ", ".join(report["disabled_families"]) or "-"],
    ]
    lines = _table([[f"{k}:", v] for k, v in head])
    lines.append("")
    rows = [["STATE", "FAMILY", "TARGET", "REASON"]]
    for row in report["targets"]:
        target = f"{row['module']}.{row['attribute']}"
        rows.append([row["state"], row["family"], target, row["reason"]])
    lines.extend(_table(rows))
    for warning in report["warnings"]:
        lines.append(f"warning: {warning}")
    return "\n".join(lines)


# -- the summary ------------------------------------------------------------------

#: Why a target may be skipped on a healthy install (reason prefix -> the
#: summary's word for it). Any other skip is unexpected.
EXPECTED_SKIPS: dict[str, str] = {
    "no such module in this Keras": "other layout",
    "already patched by family": "patched by another family",
    "nothing to patch in this Keras": "nothing to patch",
}
STATES = ("applied", "skipped", "pending", "disabled", "reverted")
#: How the text summary spells each kind of skip.
SKIP_WORDS = {
    "inherited": "inherited (its parent's patch covers it)",
    "other layout": "module of the other Keras layout",
    "gate": "gate closed",
    "nothing to patch": "module with nothing to patch in this Keras",
}


def _plural(words: str, count: int) -> str:
    """``words`` with its first word ("module") in the plural for ``count`` > 1."""
    first, _, rest = words.partition(" ")
    if count == 1 or first != "module":
        return words
    return f"modules {rest}"


def _expected_skip(reason: str, gate: dict[str, Any]) -> str | None:
    """The summary's word for an expected skip reason, or ``None``."""
    if reason.startswith("inherited from ") and reason.endswith("covered by its patch"):
        return "inherited"
    for prefix, word in EXPECTED_SKIPS.items():
        if reason.startswith(prefix):
            return word
    if gate["ok"] is False and reason == gate["reason"]:
        return "gate"
    return None


def summarize(
    report: dict[str, Any],
    *,
    imported: Callable[[str], bool] | None = None,
    exists: Callable[[str], bool] | None = None,
    all_targets: bool = True,
) -> dict[str, Any]:
    """What a person needs from ``report``: state, family counts, the unexpected.

    ``imported`` and ``exists`` tell whether a module is imported in this
    process and whether this Keras has it (defaults: ``sys.modules`` and
    :func:`keras_dtensor_fix.targets.find_spec`); ``all_targets`` says whether
    every existing target module was imported, so that one still pending is
    news. Keys: ``state`` (``active``, ``off``, ``idle`` or ``waiting``),
    ``headline``, ``python``, ``families`` (name -> ``state`` and a count per
    row state, plus ``skipped_because``), ``unexpected`` (lines) and ``ok``
    (no unexpected line).
    """
    from keras_dtensor_fix import targets

    imported = imported or (lambda name: name in sys.modules)
    exists = exists or (lambda name: targets.find_spec(name) is not None)
    gate = report["gate"]
    working = report["enabled"] and gate["ok"] is True
    families: dict[str, dict[str, Any]] = {}
    unexpected: list[str] = []
    for row in report["targets"]:
        family = families.setdefault(
            row["family"],
            {**dict.fromkeys(STATES, 0), "skipped_because": {}, "modules": set()},
        )
        state, module, reason = row["state"], row["module"], row["reason"]
        if (
            working
            and state == "pending"
            and row["attribute"] == "*"
            and imported(module)
        ):
            # A module the family only hooks (it wraps nothing there, as the
            # optimizers family's hook on ``keras``): not a target.
            continue
        family[state] = family.get(state, 0) + 1
        if not module.startswith("keras_dtensor_fix."):
            family["modules"].add(module)
        target = module if row["attribute"] == "*" else f"{module}.{row['attribute']}"
        if state == "skipped":
            word = _expected_skip(reason, gate)
            if word is None:
                word = "unexpected"
                unexpected.append(f"{row['family']}: {target} skipped: {reason}")
            because = family["skipped_because"]
            because[word] = because.get(word, 0) + 1
        elif state == "pending" and working and all_targets and exists(module):
            unexpected.append(f"{row['family']}: {target} pending: {reason}")
    disabled = set(report["disabled_families"])
    for name, family in families.items():
        modules = family.pop("modules")
        if family["applied"]:
            family["state"] = "applied"
        elif family["disabled"] or name in disabled or "*" in disabled:
            family["state"] = "disabled"
        elif family["pending"]:
            family["state"] = "pending"
        else:
            family["state"] = "skipped"
            present = sorted(m for m in modules if exists(m))
            flagged = any(line.startswith(f"{name}: ") for line in unexpected)
            if working and present and not flagged:
                unexpected.append(
                    f"{name}: nothing applied although this Keras has "
                    f"{', '.join(present)}"
                )
    if report["enabled"] and report["backend"] == "torch" and gate["ok"] is False:
        # Keras's torch backend without DTensor support: the plugin is
        # installed for nothing, and ModelParallel cannot work.
        unexpected.append(f"gate: {gate['reason']}")
    applied = sum(f["applied"] for f in families.values())
    patched = sum(1 for f in families.values() if f["applied"])
    # The headline says what holds; the lines under it say why.
    if not report["enabled"]:
        state, headline = "off", "OFF: upstream Keras runs unpatched"
    elif gate["ok"] is False:
        state, headline = "idle", "IDLE: nothing to patch here"
    elif gate["ok"] is None:
        state, headline = "waiting", "WAITING: nothing patched yet"
    else:
        state = "active"
        headline = f"ACTIVE: {applied} targets patched in {patched} families"
        if not applied:
            headline = "ACTIVE, but nothing is patched"
        off = [n for n, f in families.items() if f["state"] == "disabled"]
        if off:
            headline += f" ({len(off)} disabled: {', '.join(off)})"
    return {
        "state": state,
        "headline": headline,
        "python": platform.python_version(),
        "families": families,
        "unexpected": unexpected,
        "ok": not unexpected,
    }


def _family_table(families: dict[str, dict[str, Any]]) -> list[str]:
    counted = STATES[:4]
    rows = [["FAMILY", "STATE", *(s.upper() for s in counted), "SKIPPED BECAUSE"]]
    for name, family in families.items():
        because = ", ".join(
            f"{count} {_plural(SKIP_WORDS.get(word, word), count)}"
            for word, count in family["skipped_because"].items()
        )
        counts = [str(family[s] or "-") for s in counted]
        rows.append([name, family["state"], *counts, because or "-"])
    # Counts right-aligned under their headers.
    for i in range(2, 2 + len(counted)):
        width = max(len(row[i]) for row in rows)
        for row in rows:
            row[i] = row[i].rjust(width)
    return _table(rows)


def format_summary(report: dict[str, Any]) -> str:
    """The summary (``report["summary"]``) as text for a person."""
    summary = report["summary"]
    keras = report["keras"]
    if keras["version"]:
        keras_text = f"{keras['distribution']} {keras['version']}"
        if report["backend"]:
            keras_text += f", {report['backend']} backend"
        if report["layout"]:
            keras_text += f", {report['layout']} layout"
    else:
        keras_text = "not installed"
    gate = report["gate"]["reason"]
    failed = [n for n in report.get("notes") or [] if n.startswith("import keras ")]
    if failed:
        gate += f" ({failed[0]})"
    lines = [
        f"keras-dtensor-fix {report['version']}: {summary['headline']}",
        f"  fix:     {report['why']}",
        f"  gate:    {gate}",
        f"  Keras:   {keras_text}",
        f"  torch:   {report['torch']['version'] or 'not installed'}",
        f"  Python:  {summary['python']}",
        "",
    ]
    families = summary["families"]
    states = {family["state"] for family in families.values()}
    if len(states) == 1 and states != {"applied"}:
        # Off, idle or all disabled: one reason for every family, no table.
        state = states.pop()
        why = {"off": "the fix is off", "idle": "the gate is closed"}.get(
            summary["state"], "by KERAS_DTENSOR_FIX_DISABLE"
        )
        if summary["state"] == "waiting":
            why = "until Keras's torch backend is imported"
        lines.append(f"families: all {len(families)} {state} ({why})")
    else:
        lines.append(
            "families: patch targets by state "
            "(a whole module skipped or pending counts as 1)"
        )
        lines.extend(f"  {line}" for line in _family_table(families))
    lines.append("")
    for key in ("warnings", "notes"):
        items = report.get(key) or []
        lines.append(f"{key}: {len(items) or 'none'}")
        lines.extend(f"  - {item}" for item in items)
    unexpected = summary["unexpected"]
    lines.append(f"unexpected: {len(unexpected) or 'none'}")
    lines.extend(f"  - {item}" for item in unexpected)
    lines.append("")
    lines.append(
        "(--verbose: every target; --json: for machines; "
        "--check: exit 1 on anything unexpected)"
    )
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    notes = _load_keras(not args.keras_only)
    report = keras_dtensor_fix.status()
    report["notes"] = notes + report.get("notes", [])
    report["keras_backend_env"] = os.environ.get("KERAS_BACKEND")
    report["summary"] = summarize(report, all_targets=not args.keras_only)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(format_summary(report))
        if args.verbose:
            print()
            print(format_report(report))
    return 1 if args.check and not report["summary"]["ok"] else 0


def _demo(argv: list[str]) -> int:
    try:
        demo = importlib.import_module("keras_dtensor_fix.demo")
    except ModuleNotFoundError as exc:
        if exc.name != "keras_dtensor_fix.demo":
            raise
        print("keras_dtensor_fix.demo is not available in this build", file=sys.stderr)
        return 2
    result = demo.main(argv)
    return int(result or 0)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m keras_dtensor_fix")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="report what is patched and why")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "-v", "--verbose", action="store_true", help="also list every patch target"
    )
    status.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when something this Keras should have is not patched "
        "(a disabled family or an idle fix is not an error)",
    )
    status.add_argument(
        "--keras-only",
        action="store_true",
        help="import only keras, not every patch target module that exists",
    )
    status.set_defaults(run=_status)
    commands.add_parser(
        "demo", help="run the 2-process demonstration (arguments go to the demo)"
    )
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
