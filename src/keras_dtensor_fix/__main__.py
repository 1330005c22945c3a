"""``python -m keras_dtensor_fix status [--verbose|--json] [--check]``, ``demo``,
``plan`` (:mod:`keras_dtensor_fix.planning.cli`).

The report and its summary are :mod:`keras_dtensor_fix.report`'s; this
module loads Keras, prints them and parses arguments.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from typing import Any

import keras_dtensor_fix
from keras_dtensor_fix.engine.ledger import PENDING, STATES
from keras_dtensor_fix.report import summarize


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
    from keras_dtensor_fix.engine import patcher, targets

    if targets.gate().ok:
        for row in patcher.rows():
            module = row["module"]
            if row["state"] == PENDING and targets.find_spec(module):
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


#: How the text summary spells each kind of skip (words of ``ledger.EXPECTED``).
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
    if argv[:1] == ["plan"]:  # the planner's own arguments: planning/cli.py
        from keras_dtensor_fix.planning import cli

        return cli.main(argv[1:])
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
    commands.add_parser("plan", help="plan a layout: plan MODULE:FUNCTION --mesh 1x2")
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
