"""The wheel's start-up files: auto-activation, cheap start, metadata."""

from __future__ import annotations

import json
import re
import zipfile

import pytest

from support import FAKE_DATA_FAMILY, last_json

EXPECTED_AFTER_IMPORT_KERAS = {
    "numpy_ops": [
        ("keras.src.backend.torch.ops.numpy", "add"),
        ("keras.src.backend.torch.ops.numpy", "subtract"),
    ],
    "data": [("keras.src.backend.torch.distribution_lib", "distribute_data_input")],
    "promotion": [
        ("keras.src.backend.torch.distribution_lib", "activate_dtensor_promotion")
    ],
}

# Registers a fake, gated family at start-up, from a second .pth that runs
# after ours: the user's program below never imports keras_dtensor_fix.
STARTUP_FAMILY = FAKE_DATA_FAMILY

USER_PROGRAM = """
import json, sys
import keras
from keras.src.backend.torch import distribution_lib as dl, trainer
kdf = sys.modules["keras_dtensor_fix"]  # loaded by the .pth, not by us
status = kdf.status()
from keras_dtensor_fix.engine import patcher
print(json.dumps({
    "file": kdf.__file__,
    "active": status["enabled"],
    "ddi_chain": patcher.chain_length(dl.distribute_data_input),
    "trainer_same": trainer.distribute_data_input is dl.distribute_data_input,
    "applied": [[r["module"], r["attribute"]] for r in status["targets"]
                if r["state"] == "applied"],
}))
"""


def test_wheel_contents_and_metadata(wheel) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        pth = archive.read("keras_dtensor_fix.pth").decode()
        start = archive.read("keras_dtensor_fix.start").decode()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = archive.read(metadata_name).decode()
    assert {"keras_dtensor_fix/__init__.py", "keras_dtensor_fix/engine/patcher.py"} <= (
        names
    )
    lines = [line for line in pth.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("import ")
    assert "keras_dtensor_fix._bootstrap" in lines[0] and "except" in lines[0]
    entries = [
        line.strip()
        for line in start.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert entries == ["keras_dtensor_fix._bootstrap:boot"]
    requires = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)(.*)$", metadata, re.M)
    runtime = {name.lower() for name, rest in requires if "extra ==" not in rest}
    assert runtime == {"wrapt", "numpy", "torch"}
    assert "keras" not in {name.lower() for name, _ in requires}
    assert "keras-nightly" not in {name.lower() for name, _ in requires}
    assert "Requires-Python: >=3.11" in metadata


def test_start_entry_point_resolves(wheel_venv, run_py) -> None:
    code = """
import pkgutil
boot = pkgutil.resolve_name("keras_dtensor_fix._bootstrap:boot")
boot(); boot()
print(boot.__module__)
"""
    proc = run_py(code, python=wheel_venv, src=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "keras_dtensor_fix._bootstrap"


def test_import_keras_alone_patches(wheel_venv, run_py) -> None:
    site = wheel_venv.parents[1] / "lib"
    (site_packages,) = site.glob("python*/site-packages")
    (site_packages / "startup_family.py").write_text(STARTUP_FAMILY)
    (site_packages / "zz_startup_family.pth").write_text(
        "import keras_dtensor_fix.engine.patcher as e, startup_family as f; "
        "e.register_family(f)\n"
    )
    try:
        out = last_json(run_py(USER_PROGRAM, python=wheel_venv, src=False))
    finally:
        (site_packages / "zz_startup_family.pth").unlink()
    assert str(site_packages) in out["file"]
    assert out["active"]
    assert out["ddi_chain"] == 1 and out["trainer_same"]
    applied = {tuple(row) for row in out["applied"]}
    for family, expected in EXPECTED_AFTER_IMPORT_KERAS.items():
        assert set(expected) <= applied, (family, sorted(applied))


@pytest.mark.parametrize("family", sorted(EXPECTED_AFTER_IMPORT_KERAS))
def test_real_family_patched_by_pth_alone(wheel_venv, run_py, family) -> None:
    out = last_json(run_py(USER_PROGRAM, python=wheel_venv, src=False))
    applied = {tuple(row) for row in out["applied"]}
    assert set(EXPECTED_AFTER_IMPORT_KERAS[family]) <= applied


def test_env_off_with_pth_patches_nothing(wheel_venv, run_py) -> None:
    out = last_json(
        run_py(
            USER_PROGRAM, python=wheel_venv, src=False, env={"KERAS_DTENSOR_FIX": "0"}
        )
    )
    assert not out["active"]
    assert out["ddi_chain"] == 0 and out["applied"] == []


def _imported(stderr: str) -> set[str]:
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def test_start_is_cheap(wheel_venv, run_py) -> None:
    proc = run_py(args=["-X", "importtime", "-c", "pass"], python=wheel_venv, src=False)
    assert proc.returncode == 0, proc.stderr
    imported = _imported(proc.stderr)
    assert "keras_dtensor_fix" in imported  # the .pth ran
    assert "keras_dtensor_fix.engine.patcher" in imported  # and registered the hooks
    heavy = {
        name for name in imported if name.split(".")[0] in {"torch", "keras", "numpy"}
    }
    assert heavy == set()


def test_start_is_cheap_when_off(wheel_venv, run_py) -> None:
    proc = run_py(
        args=["-X", "importtime", "-c", "pass"],
        python=wheel_venv,
        src=False,
        env={"KERAS_DTENSOR_FIX": "off"},
    )
    imported = _imported(proc.stderr)
    assert "keras_dtensor_fix" in imported
    assert (
        "keras_dtensor_fix.engine.patcher" not in imported and "wrapt" not in imported
    )


def test_status_json_from_wheel(wheel_venv, run_py) -> None:
    proc = run_py(python=wheel_venv, src=False, module="keras_dtensor_fix")
    assert proc.returncode == 2  # no subcommand: usage error
    proc = run_py(
        python=wheel_venv,
        src=False,
        module="keras_dtensor_fix",
        argv=["status", "--json"],
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["enabled"] and report["backend"] == "torch"
