"""Stable ``keras`` over keras-nightly: one warning with the fix, and ``status``
says the same sentence.

The stable wheel (3.15.1, no ModelParallel on torch) is unpacked ahead of
site-packages on ``PYTHONPATH``: imports and package metadata then see what
``pip install keras`` over the nightly leaves (both distributions listed,
stable's files in use). Upstream (``KERAS_DTENSOR_FIX=0``) fails in Keras
with ``'NoneType' object has no attribute 'initialize'`` and says nothing.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from keras_dtensor_fix.engine import install

STABLE = "3.15.1"
FIX = (
    "run `pip uninstall -y keras keras-nightly`, then "
    f"`pip install keras-nightly=={install.NIGHTLY}`"
)
SCRIPT = """
import keras
for call in (keras.distribution.initialize, keras.distribution.list_devices):
    try:
        call()
    except AttributeError as exc:
        print("keras failed:", exc)
"""


@pytest.fixture(scope="module")
def stable_keras(tmp_path_factory):
    """A folder holding stable keras's files and metadata (pip's own client)."""
    root = tmp_path_factory.mktemp("stable")
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "-q"]
    proc = subprocess.run(
        [*download, "-d", str(root), f"keras=={STABLE}"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    wheels = list(root.glob("keras-*.whl"))
    if proc.returncode or not wheels:
        pytest.skip(f"keras=={STABLE} cannot be downloaded: {proc.stderr[-300:]}")
    site = root / "site"
    with zipfile.ZipFile(wheels[0]) as wheel:
        wheel.extractall(site)
    return site


def _flat(text: str) -> str:
    return " ".join(text.split())


def test_a_distributed_script_warns_once_with_the_fix(run_py, stable_keras) -> None:
    proc = run_py(SCRIPT, path=[stable_keras])
    assert "keras failed: 'NoneType' object has no attribute" in proc.stdout
    err = _flat(proc.stderr)
    assert err.count("keras-dtensor-fix: ") == 1, proc.stderr
    assert f"keras {STABLE} is installed over keras-nightly" in err
    assert FIX in err
    # Upstream: the same failure, and no word on why.
    off = run_py(SCRIPT, path=[stable_keras], env={"KERAS_DTENSOR_FIX": "0"})
    assert "keras failed: " in off.stdout and "keras-dtensor-fix" not in off.stderr


def test_a_one_device_script_is_not_warned(run_py, stable_keras) -> None:
    code = "import keras; print(keras.layers.Dense(2)(keras.ops.ones((1, 3))).shape)"
    proc = run_py(code, path=[stable_keras])
    assert proc.returncode == 0, proc.stderr
    assert "keras-dtensor-fix" not in proc.stderr


def test_status_says_the_same_sentence(run_py, stable_keras) -> None:
    warned = _flat(run_py(SCRIPT, path=[stable_keras]).stderr)
    sentence = warned.split("keras-dtensor-fix: ", 1)[1].split("`pip install")[0]
    for argv in ([], ["--check"]):
        proc = run_py(
            module="keras_dtensor_fix", argv=["status", *argv], path=[stable_keras]
        )
        out = _flat(proc.stdout)
        assert proc.returncode == (1 if argv else 0), proc.stderr + proc.stdout
        assert "NOT READY" in out and sentence in out, out
        assert f"Keras: keras {STABLE}, torch backend" in out
        # One story: nothing claims this Keras has torch distribution.
        assert (
            "keras-nightly has it" not in out and "with distribution support" not in out
        )


def test_the_nightly_does_not_warn(run_py) -> None:
    proc = run_py(
        "import keras; keras.distribution.list_devices()", args=["-W", "error"]
    )
    assert proc.returncode == 0, proc.stderr
    assert install.keras_problem() is None
