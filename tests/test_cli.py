"""``python -m keras_dtensor_fix status [--verbose|--json] [--check]`` and ``demo``."""

from __future__ import annotations

import json

import pytest

from keras_dtensor_fix.__main__ import format_summary, summarize
from keras_dtensor_fix.engine.config import FAMILIES

KEYS = {
    "version",
    "keras",
    "torch",
    "backend",
    "layout",
    "enabled",
    "why",
    "gate",
    "disabled_families",
    "targets",
    "warnings",
    "summary",
}
FIELDS = ("family", "module", "attribute", "state", "reason", "cause")
SUMMARY_KEYS = {"state", "headline", "python", "families", "unexpected", "ok"}

# Keras's own random module moved dropout away: the family says so with a
# LookupError, as it would on such a build.
MOVED_DROPOUT = """
import dataclasses, sys
import keras_dtensor_fix.patches.random as family

def patches(module):
    raise LookupError("random.dropout not found")

family.IMPLEMENTATION = dataclasses.replace(family.IMPLEMENTATION, patches=patches)
from keras_dtensor_fix.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def status(run_py, *argv: str, env=None, path=()):
    return run_py(
        module="keras_dtensor_fix", argv=["status", *argv], env=env, path=path
    )


def test_status_json_under_torch(run_py) -> None:
    proc = status(run_py, "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert KEYS <= set(report)
    assert report["version"] == "0.1.0"
    assert report["keras"]["distribution"] == "keras-nightly"
    assert report["torch"]["version"]
    assert report["backend"] == "torch" and report["layout"] in ("ops", "flat")
    assert report["enabled"] and report["gate"]["ok"] is True
    for row in report["targets"]:
        assert {"family", "module", "attribute", "state", "reason"} <= set(row)
        assert row["state"] in {"applied", "skipped", "disabled", "pending", "reverted"}
    summary = report["summary"]
    assert SUMMARY_KEYS <= set(summary)
    assert summary["state"] == "active" and summary["ok"], summary["unexpected"]
    assert summary["unexpected"] == []
    assert set(FAMILIES) <= set(summary["families"])
    applied = sum(r["state"] == "applied" for r in report["targets"])
    assert sum(f["applied"] for f in summary["families"].values()) == applied
    for name in FAMILIES:
        family = summary["families"][name]
        assert family["state"] == "applied" and family["applied"] > 0, name
        assert family["pending"] == 0, name  # every target module was imported


def test_status_summary_is_short(run_py) -> None:
    proc = status(run_py)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    lines = out.splitlines()
    assert lines[0].startswith("keras-dtensor-fix 0.1.0: ACTIVE: ")
    assert "targets patched in" in lines[0]
    for word in ("fix:", "gate:", "Keras:", "torch:", "Python:", "families:"):
        assert word in out
    assert "unexpected: none" in out and "warnings: none" in out
    for name in FAMILIES:
        assert any(line.split()[:2] == [name, "applied"] for line in lines), name
    # No per-target table: one screen, not one line per wrapped function.
    assert "REASON" not in out and len(lines) < 40


def test_status_verbose_lists_every_target(run_py) -> None:
    proc = status(run_py, "--verbose")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("keras-dtensor-fix 0.1.0: ACTIVE")
    for word in ("keras-dtensor-fix:", "Keras:", "torch:", "backend:", "STATE"):
        assert word in out
    assert "REASON" in out
    targets = [line for line in out.splitlines() if line.startswith("applied ")]
    assert len(targets) > 100


@pytest.mark.parametrize(
    ("env", "state"),
    [
        ({"KERAS_BACKEND": "numpy"}, "idle"),
        ({"KERAS_BACKEND": "tensorflow"}, "waiting"),  # not installed
        ({"KERAS_DTENSOR_FIX": "0"}, "off"),
        ({"KERAS_DTENSOR_FIX": "maybe", "KERAS_DTENSOR_FIX_DISABLE": "bogus,*"}, None),
    ],
)
@pytest.mark.parametrize("as_json", [True, False])
def test_status_exits_zero(run_py, env, state, as_json) -> None:
    """Off, idle, no Keras, everything disabled: nothing expected is missing."""
    argv = ["--json", "--check"] if as_json else []
    proc = status(run_py, *argv, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    if as_json:
        report = json.loads(proc.stdout)
        assert KEYS <= set(report)
        summary = report["summary"]
        assert summary["ok"] and summary["unexpected"] == []
        if state:
            assert summary["state"] == state
        if env.get("KERAS_BACKEND") == "numpy":
            assert report["gate"]["ok"] is False
            assert "numpy" in report["gate"]["reason"]
            assert all(r["state"] != "applied" for r in report["targets"])
        if env.get("KERAS_DTENSOR_FIX_DISABLE"):
            assert {f["state"] for f in summary["families"].values()} == {"disabled"}
            assert any("maybe" in w for w in report["warnings"])
    else:
        head = proc.stdout.splitlines()[0]
        word = {"idle": "IDLE", "waiting": "WAITING", "off": "OFF"}.get(state)
        assert word is None or f": {word}: " in head, head


def test_status_check_fails_on_an_unexpected_skip(run_py) -> None:
    """A target this Keras should have, skipped: exit 1 with --check only."""
    not_strict = {"KERAS_DTENSOR_FIX_STRICT": None}  # strict would raise at import
    proc = run_py(MOVED_DROPOUT, argv=["status", "--check"], env=not_strict)
    assert proc.returncode == 1, proc.stderr + proc.stdout
    out = proc.stdout
    assert "unexpected: 1" in out
    assert "random: keras.src.backend.torch.random skipped: " in out
    assert "random.dropout not found" in out
    random_row = next(line for line in out.splitlines() if "  random " in line)
    assert random_row.split()[:2] == ["random", "skipped"]
    assert "1 unexpected" in random_row
    # Without --check the same report exits 0; --json carries the finding.
    proc = run_py(MOVED_DROPOUT, argv=["status", "--json"], env=not_strict)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)["summary"]
    assert not summary["ok"] and len(summary["unexpected"]) == 1
    assert summary["families"]["random"]["skipped_because"] == {"unexpected": 1}


def test_status_check_passes_with_a_family_disabled(run_py) -> None:
    proc = status(run_py, "--check", env={"KERAS_DTENSOR_FIX_DISABLE": "random"})
    assert proc.returncode == 0, proc.stderr + proc.stdout
    head = proc.stdout.splitlines()[0]
    assert "ACTIVE: " in head and "(1 disabled: random)" in head
    assert "unexpected: none" in proc.stdout


def test_status_without_keras(run_py, tmp_path) -> None:
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text("raise ImportError('no keras')\n")
    proc = status(run_py, "--json", path=[tmp_path])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert any("no keras" in note for note in report["notes"])
    assert report["summary"]["state"] == "waiting"
    proc = status(run_py, path=[tmp_path])
    assert proc.returncode == 0, proc.stderr
    assert "import keras failed: ImportError: no keras" in proc.stdout


# -- summarize() on made-up reports ---------------------------------------------


def _report(rows, *, enabled=True, gate=True, backend="torch", disabled=()):
    return {
        "version": "0.1.0",
        "keras": {"version": "3.16.0.dev0", "distribution": "keras-nightly"},
        "torch": {"version": "2.13.0"},
        "backend": backend,
        "layout": "ops",
        "enabled": enabled,
        "why": "test",
        "gate": {"ok": gate, "reason": "gate says so"},
        "disabled_families": list(disabled),
        "targets": [dict(zip(FIELDS, row, strict=True)) for row in rows],
        "warnings": [],
        "notes": [],
    }


def _summary(report, exists=("k.a", "k.b"), **kw):
    return summarize(report, exists=lambda name: name in exists, **kw)


def test_summary_counts_and_expected_skips() -> None:
    report = _report(
        [
            ("f", "k.a", "x", "applied", "wrapped", "wrapped"),
            (
                "f",
                "k.a",
                "C.m",
                "skipped",
                "inherited from B; covered by its patch",
                "inherited",
            ),
            (
                "f",
                "k.old",
                "*",
                "skipped",
                "no such module in this Keras (layout ops)",
                "other_layout",
            ),
            (
                "g",
                "k.b",
                "*",
                "disabled",
                "disabled by KERAS_DTENSOR_FIX_DISABLE",
                "disabled",
            ),
        ],
        disabled=["g"],
    )
    summary = _summary(report)
    assert summary["ok"] and summary["state"] == "active"
    f = summary["families"]["f"]
    assert (f["applied"], f["skipped"], f["pending"]) == (1, 2, 0)
    assert f["skipped_because"] == {"inherited": 1, "other layout": 1}
    assert summary["families"]["g"]["state"] == "disabled"
    assert summary["headline"] == (
        "ACTIVE: 1 targets patched in 1 families (1 disabled: g)"
    )
    report["summary"] = summary
    text = format_summary(report)
    assert "1 inherited (its parent's patch covers it)" in text


@pytest.mark.parametrize(
    ("row", "why"),
    [
        (
            ("f", "k.a", "y", "skipped", "not found: k.a.y", "not_found"),
            "k.a.y skipped: not found",
        ),
        (
            (
                "f",
                "k.a",
                "C.m",
                "skipped",
                "inherited from B; not patched there",
                "inherited_unpatched",
            ),
            "k.a.C.m skipped: inherited from B; not patched there",
        ),
        (
            ("f", "k.b", "*", "pending", "module not imported yet", "not_imported"),
            "k.b pending",
        ),
    ],
)
def test_summary_flags_the_unexpected(row, why) -> None:
    report = _report([("f", "k.a", "x", "applied", "wrapped", "wrapped"), row])
    summary = _summary(report)
    assert not summary["ok"]
    assert len(summary["unexpected"]) == 1
    assert summary["unexpected"][0].startswith(f"f: {why}")


def test_summary_pending_is_news_only_when_every_target_was_imported() -> None:
    report = _report(
        [
            ("f", "k.a", "x", "applied", "wrapped", "wrapped"),
            ("f", "k.b", "*", "pending", "module not imported yet", "not_imported"),
        ]
    )
    assert _summary(report, all_targets=False)["ok"]


def test_summary_flags_a_family_that_applied_nothing() -> None:
    # Every row "expected", yet nothing applied in modules this Keras has.
    why = "already patched by family g"
    rows = [("f", "k.a", "C.m", "skipped", why, "patched_by_family")]
    summary = _summary(_report(rows))
    assert summary["unexpected"] == ["f: nothing applied although this Keras has k.a"]


def test_summary_off_and_idle_are_not_errors() -> None:
    why = "keras_dtensor_fix is not active"
    pending = [("f", "k.a", "*", "pending", why, "not_active")]
    off = _summary(_report(pending, enabled=False))
    assert off["state"] == "off" and off["ok"]
    gated = [("f", "k.a", "*", "skipped", "gate says so", "gate_closed")]
    idle = _summary(_report(gated, gate=False, backend="numpy"))
    assert idle["state"] == "idle" and idle["ok"]
    assert idle["families"]["f"]["skipped_because"] == {"gate": 1}
    # The torch backend without DTensor support: ModelParallel cannot work.
    broken = _summary(_report(gated, gate=False))
    assert broken["unexpected"] == ["gate: gate says so"]
    # ... unless the fix is off anyway.
    assert _summary(_report(gated, gate=False, enabled=False))["ok"]


def test_demo_is_delegated(run_py) -> None:
    code = """
import sys, types
demo = types.ModuleType("keras_dtensor_fix.demo")
demo.main = lambda argv: print("demo got", argv) or 3
sys.modules["keras_dtensor_fix.demo"] = demo
from keras_dtensor_fix.__main__ import main
sys.exit(main(["demo", "--ranks", "2", "-v"]))
"""
    proc = run_py(code)
    assert proc.returncode == 3, proc.stderr
    assert "demo got ['--ranks', '2', '-v']" in proc.stdout
