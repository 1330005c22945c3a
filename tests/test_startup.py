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
woken = "keras_dtensor_fix" in sys.modules  # by the .pth's watcher, not by us
import keras_dtensor_fix as kdf
status = kdf.status()
from keras_dtensor_fix.engine import patcher
print(json.dumps({
    "file": kdf.__file__,
    "woken": woken,
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
    assert "_keras_dtensor_fix_boot" in lines[0] and "except" in lines[0]
    assert "_keras_dtensor_fix_boot.py" in names  # the hook, outside the package
    entries = [
        line.strip()
        for line in start.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]
    assert entries == ["_keras_dtensor_fix_boot:boot"]
    requires = re.findall(r"^Requires-Dist: ([A-Za-z0-9_.-]+)(.*)$", metadata, re.M)
    runtime = {name.lower() for name, rest in requires if "extra ==" not in rest}
    assert runtime == {"wrapt", "numpy", "torch"}
    assert "keras" not in {name.lower() for name, _ in requires}
    assert "keras-nightly" not in {name.lower() for name, _ in requires}
    assert "Requires-Python: >=3.11" in metadata


def test_start_entry_point_resolves(wheel_venv, run_py) -> None:
    code = """
import pkgutil
boot = pkgutil.resolve_name("_keras_dtensor_fix_boot:boot")
boot(); boot()
print(boot.__module__)
"""
    proc = run_py(code, python=wheel_venv, src=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "_keras_dtensor_fix_boot"


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
    assert out["active"] and out["woken"]
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
    assert not out["active"] and not out["woken"]
    assert out["ddi_chain"] == 0 and out["applied"] == []


def _imported(stderr: str) -> set[str]:
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def _imported_by(stderr: str, top: str) -> list[str]:
    """The modules first imported under ``top`` (``-X importtime`` prints a
    module's imports just before it, indented deeper), ``top`` included."""
    entries = []
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            field = line.rsplit("|", 1)[1]
            entries.append((len(field) - len(field.lstrip()), field.strip()))
    for index, (depth, name) in enumerate(entries):
        if name == top:
            gained = [name]
            for child_depth, child in reversed(entries[:index]):
                if child_depth <= depth:
                    break
                gained.append(child)
            return gained
    return []


#: Everything a bare ``python -c pass`` may import because the plugin is
#: installed: the ``.pth``'s hook module. The package, wrapt and the engine
#: wait for Keras or torch.
BOOT_MODULES = {"_keras_dtensor_fix_boot"}


@pytest.mark.parametrize("switch", ["on", "off"])
def test_start_imports_only_the_hook(wheel_venv, run_py, switch) -> None:
    proc = run_py(
        args=["-X", "importtime", "-c", "pass"],
        python=wheel_venv,
        src=False,
        env={"KERAS_DTENSOR_FIX": switch},
    )
    assert proc.returncode == 0, proc.stderr
    gained = _imported_by(proc.stderr, "_keras_dtensor_fix_boot")
    assert gained, "the .pth did not run"
    assert set(gained) <= BOOT_MODULES, sorted(set(gained) - BOOT_MODULES)
    imported = _imported(proc.stderr)
    assert not {"wrapt", "keras_dtensor_fix"} & imported
    heavy = {
        name for name in imported if name.split(".")[0] in {"torch", "keras", "numpy"}
    }
    assert heavy == set()


WAKE_PROGRAM = """
import json, sys
before = "keras_dtensor_fix" in sys.modules
import {module}
from keras_dtensor_fix.engine import patcher
ours = [f for f in sys.meta_path if type(f).__module__.startswith("_keras_dtensor")]
print(json.dumps({{"before": before, "active": patcher.is_active(),
                  "watchers": [type(f).__name__ for f in ours]}}))
"""


@pytest.mark.parametrize("module", ["keras", "torch", "keras_dtensor_fix"])
def test_first_watched_import_activates(wheel_venv, run_py, module) -> None:
    """Keras or torch wakes the fix; importing the package activates it at once."""
    out = last_json(
        run_py(WAKE_PROGRAM.format(module=module), python=wheel_venv, src=False)
    )
    assert out == {"before": False, "active": True, "watchers": []}


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
