"""``python -m keras_dtensor_fix status [--verbose|--json] [--check]`` and ``demo``."""

from __future__ import annotations

import json

import pytest

from keras_dtensor_fix import status_text
from keras_dtensor_fix.__main__ import summarize
from keras_dtensor_fix.engine.config import FAMILIES
from support import ROOT

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
    "problems",
    "configured_backend",
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


#: Words of the code that the default output must not use (docs/status.md).
JARGON = ("famil", "target", "gate", "layout", "KerasDTensorPromotionMode", "dispatch")


def _flat(text: str) -> str:
    """``text`` with its lines re-joined (items wrap at 100 columns)."""
    return " ".join(text.split())


def test_status_default_is_quick_and_plain(run_py) -> None:
    """The default answer imports no Keras, in plain words on one screen."""
    code = """
import sys
from keras_dtensor_fix.__main__ import main
code = main(["status"])
imported = [name in sys.modules for name in ("keras", "torch")]
print("keras imported: {} torch imported: {}".format(*imported))
sys.exit(code)
"""
    proc = run_py(code)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("keras-dtensor-fix 0.1.0: READY: "), out
    assert "keras imported: False torch imported: False" in out
    for word in ("plugin:", "Keras:", "torch:", "Python:", "--check"):
        assert word in out
    assert "keras-nightly 3.16" in out and "torch backend (from KERAS_BACKEND)" in out
    text = out.split("keras imported:")[0].lower()
    assert not [word for word in JARGON if word.lower() in text], text
    assert len(out.splitlines()) < 15 and proc.stderr == ""


def test_status_check_is_plain_and_quiet(run_py) -> None:
    """--check imports everything; third-party warnings stay out of it."""
    proc = status(run_py, "--check")
    assert proc.returncode == 0, proc.stderr + proc.stdout
    out = proc.stdout
    assert out.startswith("keras-dtensor-fix 0.1.0: ACTIVE: "), out
    assert "Keras functions patched" in out.splitlines()[0]
    assert "problems: none" in out and "warnings: none" in out
    assert "absl" not in proc.stdout + proc.stderr, proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr
    lowered = out.lower()
    assert not [w for w in JARGON if w.lower() in lowered], out


def test_status_verbose_groups_by_family(run_py) -> None:
    proc = status(run_py, "--verbose")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("keras-dtensor-fix 0.1.0: ACTIVE")
    heads = [line for line in lines if line and not line.startswith(" ")]
    for name in FAMILIES:
        assert any(line.startswith(f"{name} [applied; ") for line in heads), name
    # Targets grouped by module: one line per module, not one per function.
    assert sum("applied" in line for line in lines) > len(FAMILIES)
    assert "Adam._parallel_update_step" in proc.stdout
    assert len(lines) < 200
    assert "notes:" in proc.stdout


@pytest.mark.parametrize(
    ("env", "state"),
    [
        ({"KERAS_DTENSOR_FIX": "0"}, "off"),
        ({"KERAS_DTENSOR_FIX": "maybe", "KERAS_DTENSOR_FIX_DISABLE": "bogus,*"}, None),
    ],
)
@pytest.mark.parametrize("as_json", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_status_exits_zero(run_py, env, state, as_json) -> None:
    """Off or everything disabled: a choice, not a problem."""
    argv = ["--json", "--check"] if as_json else ["--check"]
    proc = status(run_py, *argv, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    if as_json:
        report = json.loads(proc.stdout)
        assert KEYS <= set(report)
        summary = report["summary"]
        assert summary["ok"] and summary["unexpected"] == []
        if state:
            assert summary["state"] == state
        if env.get("KERAS_DTENSOR_FIX_DISABLE"):
            assert {f["state"] for f in summary["families"].values()} == {"disabled"}
            assert any("maybe" in w for w in report["warnings"])
    elif state:
        assert ": OFF: " in proc.stdout.splitlines()[0]


@pytest.mark.parametrize("backend", [None, "numpy", "tensorflow"])
def test_status_check_fails_unless_the_backend_is_torch(
    run_py, tmp_path, backend
) -> None:
    """Unset (Keras's default, tensorflow), numpy, tensorflow (not installed):
    a ModelParallel script would run unpatched; --check says so and fails."""
    env = {"KERAS_BACKEND": backend, "KERAS_HOME": str(tmp_path)}  # no keras.json
    proc = status(run_py, "--check", env=env)
    assert proc.returncode == 1, proc.stderr + proc.stdout
    out = _flat(proc.stdout)
    name = backend or "tensorflow"
    assert f"NOT READY: Keras's backend is '{name}'" in out, out
    assert "run `export KERAS_BACKEND=torch`" in out
    if backend == "numpy":
        report = json.loads(status(run_py, "--json", env=env).stdout)
        assert report["gate"]["ok"] is False and report["summary"]["state"] == (
            "not ready"
        )
        assert all(
            r["state"] != "applied"
            for r in report["targets"]
            if r["family"] != "install_check"
        )
    # The quick answer says the same, exit 0 without --check.
    proc = status(run_py, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0].endswith("NOT READY")
    assert f"Keras's backend is '{name}'" in _flat(proc.stdout)


def test_status_check_fails_on_an_unexpected_skip(run_py) -> None:
    """A target this Keras should have, skipped: exit 1 with --check only."""
    not_strict = {"KERAS_DTENSOR_FIX_STRICT": None}  # strict would raise at import
    proc = run_py(MOVED_DROPOUT, argv=["status", "--check"], env=not_strict)
    assert proc.returncode == 1, proc.stderr + proc.stdout
    out = _flat(proc.stdout)
    assert "problems: 1" in out
    assert "random: keras.src.backend.torch.random skipped: " in out
    assert "random.dropout not found" in out
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
    assert "problems: none" in proc.stdout


def test_status_check_fails_without_keras(run_py, tmp_path) -> None:
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text("raise ImportError('no keras')\n")
    proc = status(run_py, "--check", path=[tmp_path])
    assert proc.returncode == 1, proc.stderr + proc.stdout
    out = _flat(proc.stdout)
    assert "NOT READY: Keras cannot be imported (ImportError: no keras)" in out
    proc = status(run_py, "--json", path=[tmp_path])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert any("no keras" in note for note in report["notes"])
    assert report["summary"]["state"] == "not ready"


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
        "ACTIVE: 1 Keras functions patched (1 group) (1 disabled: g)"
    )
    report["summary"] = summary
    text = _flat(status_text.by_family(report))
    assert "f [applied; 1 applied, 2 skipped]:" in text
    assert "skipped k.a.C.m: inherited from B; covered by its patch" in text
    assert "applied k.a: x" in text


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


def test_summary_problems_are_unexpected_unless_off() -> None:
    report = _report([("f", "k.a", "x", "applied", "wrapped", "wrapped")])
    report["problems"] = ["Keras's backend is 'jax': run this"]
    summary = _summary(report)
    assert summary["unexpected"] == report["problems"]
    assert summary["state"] == "not ready"
    assert summary["headline"] == "NOT READY: Keras's backend is 'jax': run this"
    off = _summary({**report, "enabled": False})
    assert off["ok"] and off["state"] == "off"


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


def test_gpu_check_skips_cleanly_without_cuda(run_py) -> None:
    """``nox -s gpu`` on a machine with no CUDA device: one line, exit 0."""
    script = ROOT / "benchmarks" / "gpu_check.py"
    code = f"import runpy; runpy.run_path({str(script)!r}, run_name='__main__')"
    proc = run_py(code, env={"CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "gpu: skipped: no CUDA device here (torch.cuda.is_available() is False)"
    ]
