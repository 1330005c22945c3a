"""``python -m keras_dtensor_fix status [--verbose|--json] [--check]``, ``demo``,
``plan``: parses arguments, loads Keras where asked, prints
:mod:`keras_dtensor_fix.report`'s report as :mod:`.status_text` writes it."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator

import keras_dtensor_fix
from keras_dtensor_fix import status_text
from keras_dtensor_fix.engine.ledger import PENDING
from keras_dtensor_fix.report import problems, summarize

__all__ = ["main", "summarize"]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Third-party warnings out of the output (the plugin's reach the report)."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings(action="ignore"):
            yield
    finally:
        logging.disable(previous)


def _load_keras(all_targets: bool) -> tuple[list[str], str | None]:
    """Import Keras (with ``all_targets``, every module the plugin patches):
    notes on failures, and how importing Keras itself failed."""
    notes: list[str] = []
    with _quiet():
        try:
            importlib.import_module("keras")
        except Exception as exc:  # noqa: BLE001 - report, never fail
            error = f"{type(exc).__name__}: {exc}"
            return [f"import keras failed: {error}"], error
        from keras_dtensor_fix.engine import patcher, targets

        if all_targets and targets.gate().ok:
            for row in patcher.rows():
                module = row["module"]
                if row["state"] == PENDING and targets.find_spec(module):
                    try:
                        importlib.import_module(module)
                    except Exception as exc:  # noqa: BLE001
                        notes.append(f"import {module} failed: {exc}")
    return notes, None


def _status(args: argparse.Namespace) -> int:
    # The default answer imports no Keras (seconds saved).
    deep = args.check or args.verbose or args.json or args.keras_only
    notes, import_error = _load_keras(not args.keras_only) if deep else ([], None)
    report = keras_dtensor_fix.status()
    report["notes"] = notes + report.get("notes", [])
    report["problems"] = problems(import_error)
    report["keras_backend_env"] = os.environ.get("KERAS_BACKEND")
    report["summary"] = summarize(report, all_targets=not args.keras_only)
    if args.json:
        print(json.dumps(report, indent=2, sort_keys=True))
    elif not deep:
        print(status_text.quick(report))
    else:
        print(status_text.checked(report))
        if args.verbose:
            print(f"\n{status_text.by_family(report)}")
    return 1 if args.check and not report["summary"]["ok"] else 0


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    argv = sys.argv[1:] if argv is None else list(argv)
    own = {"demo": "keras_dtensor_fix.demo", "plan": "keras_dtensor_fix.planning.cli"}
    if argv and argv[0] in own:  # a command that parses its own arguments
        return importlib.import_module(own[argv[0]]).main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m keras_dtensor_fix")
    commands = parser.add_subparsers(dest="command", required=True)
    status = commands.add_parser("status", help="report what is patched and why")
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument(
        "-v", "--verbose", action="store_true", help="also list every patch, by group"
    )
    status.add_argument(
        "--check",
        action="store_true",
        help="import Keras and exit 1 on a problem: Keras missing or without "
        "torch ModelParallel, a backend other than torch, a patch that did not "
        "apply (the plugin switched off, or groups disabled, are no error)",
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
