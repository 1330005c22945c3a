"""``python -m keras_dtensor_fix status`` as text for a person: :func:`quick` (the
default, without importing Keras), :func:`checked` (``--check``) and :func:`by_family`
(``--verbose``). The terms are docs/status.md's."""

from __future__ import annotations

import textwrap
from typing import Any

from keras_dtensor_fix.engine import families as _families
from keras_dtensor_fix.engine.ledger import ANY, APPLIED, SKIPPED

WIDTH = 100


def _wrap(indent: str, text: str) -> list[str]:
    hang = " " * len(indent)
    return textwrap.wrap(text, WIDTH, initial_indent=indent, subsequent_indent=hang)


def _items(title: str, items: list[str]) -> list[str]:
    lines = [f"{title}: {len(items) or 'none'}"]
    for item in items:
        lines += _wrap("  - ", item)
    return lines


def _head(report: dict[str, Any], verdict: str) -> list[str]:
    keras = report["keras"]
    backend = report.get("configured_backend") or {}
    keras_text = "not installed"
    if keras["version"]:
        keras_text = f"{keras['distribution']} {keras['version']}"
        if backend:
            keras_text += f", {backend['name']} backend (from {backend['from']})"
    return [
        f"keras-dtensor-fix {report['version']}: {verdict}",
        f"  plugin:  {'on' if report['enabled'] else 'off'} ({report['why']})",
        f"  Keras:   {keras_text}",
        f"  torch:   {report['torch']['version'] or 'not installed'}",
        f"  Python:  {report['summary']['python']}",
    ]


def quick(report: dict[str, Any]) -> str:
    """The default answer: can a ModelParallel script get the fix here?"""
    problems = report.get("problems") or []
    if not report["enabled"]:
        head = "OFF: scripts run on upstream Keras, unpatched"
    elif problems:
        head = "NOT READY"
    else:
        head = "READY: a script's ModelParallel gets the fix when it imports Keras"
    lines = _head(report, head)
    if problems:
        lines += ["", *_items("problems", problems)]
    lines += [
        "",
        "--check: import Keras, check every patch, exit 1 on a problem; "
        "--verbose: list the patches; --json: for programs",
    ]
    return "\n".join(lines)


def checked(report: dict[str, Any]) -> str:
    """After importing Keras: the summary's verdict and what is unexpected."""
    summary = report["summary"]
    lines = [
        *_head(report, summary["headline"]),
        "",
        *_items("problems", summary["unexpected"]),
        *_items("warnings", report.get("warnings") or []),
    ]
    return "\n".join(lines)


def by_family(report: dict[str, Any]) -> str:
    """Every target, grouped by patch group (family) and module."""
    summary = report["summary"]
    groups: dict[str, list[dict[str, str]]] = {}
    for row in report["targets"]:
        groups.setdefault(row["family"], []).append(row)
    summaries = {row.name: row.summary for row in _families.FAMILIES}
    lines = ["patches by group (KERAS_DTENSOR_FIX_DISABLE takes these names):"]
    for name, rows in groups.items():
        family = summary["families"].get(name, {})
        what = summaries.get(name, "registered at run time")
        counts = ", ".join(
            f"{family[s]} {s}" for s in (APPLIED, SKIPPED) if family.get(s)
        )
        lines += ["", f"{name} [{family.get('state', '?')}; {counts or '-'}]: {what}"]
        applied: dict[str, list[str]] = {}
        for row in rows:
            if row["state"] == APPLIED:
                applied.setdefault(row["module"], []).append(row["attribute"])
                continue
            attribute = "" if row["attribute"] == ANY else f".{row['attribute']}"
            target = row["module"] + attribute
            lines += _wrap(f"  {row['state']:8} ", f"{target}: {row['reason']}")
        for module, attributes in applied.items():
            lines += _wrap(f"  {APPLIED:8} ", f"{module}: {', '.join(attributes)}")
    lines += ["", *_items("notes", report.get("notes") or [])]
    return "\n".join(lines)
