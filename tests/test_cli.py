"""``python -m keras_dtensor_fix status [--json]`` and ``demo``."""

from __future__ import annotations

import json

import pytest

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
}


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


def test_status_human_form(run_py) -> None:
    proc = status(run_py)
    assert proc.returncode == 0, proc.stderr
    for word in (
        "keras-dtensor-fix",
        "Keras:",
        "torch:",
        "backend:",
        "STATE",
        "REASON",
    ):
        assert word in proc.stdout


@pytest.mark.parametrize(
    "env",
    [
        {"KERAS_BACKEND": "numpy"},
        {"KERAS_BACKEND": "tensorflow"},  # not installed: import keras fails
        {"KERAS_DTENSOR_FIX": "0"},
        {"KERAS_DTENSOR_FIX": "maybe", "KERAS_DTENSOR_FIX_DISABLE": "bogus,*"},
    ],
)
@pytest.mark.parametrize("as_json", [True, False])
def test_status_exits_zero(run_py, env, as_json) -> None:
    proc = status(run_py, *(["--json"] if as_json else []), env=env)
    assert proc.returncode == 0, proc.stderr
    if as_json:
        report = json.loads(proc.stdout)
        assert KEYS <= set(report)
        if env.get("KERAS_BACKEND") == "numpy":
            assert report["gate"]["ok"] is False
            assert "numpy" in report["gate"]["reason"]
            assert all(r["state"] != "applied" for r in report["targets"])


def test_status_without_keras(run_py, tmp_path) -> None:
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text("raise ImportError('no keras')\n")
    proc = status(run_py, "--json", path=[tmp_path])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert any("no keras" in note for note in report["notes"])


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
