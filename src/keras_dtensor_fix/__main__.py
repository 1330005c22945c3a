"""``python -m keras_dtensor_fix status [--json]`` and ``... demo [ARGS]``."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
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
    """The status report as text for a person."""
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


def _status(args: argparse.Namespace) -> int:
    notes = _load_keras(not args.keras_only)
    report = keras_dtensor_fix.status()
    report["notes"] = notes + report.get("notes", [])
    report["keras_backend_env"] = os.environ.get("KERAS_BACKEND")
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    else:
        print(format_report(report))
        for note in report["notes"]:
            print(f"note: {note}")
    return 0


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
