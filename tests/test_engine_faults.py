"""The patch engine when a family or a patch fails: import of Keras never
breaks (outside strict mode), strict mode raises; each case in a new
interpreter."""

from __future__ import annotations

import pytest

from support import last_json


@pytest.fixture
def run_py(lenient_run_py):
    return lenient_run_py


BROKEN = """
from keras_dtensor_fix.engine.contract import Patch
FAMILY = "data"
MODULES = ({module!r},)
def patches(module):
    raise RuntimeError("boom in patches()")
def after_apply():
    raise RuntimeError("boom in after_apply()")
"""

BROKEN_AFTER = """
from keras_dtensor_fix.engine.contract import Patch
FAMILY = "compile"
MODULES = ({module!r},)
def keep(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)
def patches(module):
    return [Patch(module.__name__, "no_such_attribute", keep),
            Patch("module.not.imported", "x", keep)]
def after_apply():
    raise RuntimeError("boom in after_apply()")
"""


def test_raising_family_does_not_break_import_keras(run_py, tmp_path) -> None:
    module = "keras.src.backend.torch.distribution_lib"
    (tmp_path / "broken_family.py").write_text(BROKEN.format(module=module))
    (tmp_path / "broken_after.py").write_text(BROKEN_AFTER.format(module=module))
    code = """
import json
from keras_dtensor_fix.engine import patcher
import broken_family, broken_after
patcher.register_family(broken_family)
patcher.register_family(broken_after)
import keras
import keras.src.backend.torch.distribution_lib as dl
x = keras.ops.add(keras.ops.ones((2,)), 1.0)
rows = [r for r in patcher.rows() if r["family"] in ("data", "compile")
        and r["module"] != "keras_dtensor_fix.patches.data"]
print(json.dumps({"sum": float(keras.ops.sum(x)), "rows": rows}))
"""
    proc = run_py(code, path=[tmp_path])
    out = last_json(proc)
    assert out["sum"] == 4.0
    by_family = {}
    for row in out["rows"]:
        by_family.setdefault(row["family"], []).append(row)
    broken = [r for r in by_family["data"] if r["module"] == module]
    assert any(
        r["state"] == "skipped" and "boom in patches()" in r["reason"] for r in broken
    ), broken
    states = {(r["attribute"], r["state"]) for r in by_family["compile"]}
    assert ("no_such_attribute", "skipped") in states
    assert ("x", "skipped") in states
    assert "boom in patches()" in proc.stderr
    assert "boom in after_apply()" in proc.stderr


def test_broken_gate_does_not_break_import_keras(run_py, fakes) -> None:
    code = """
import json
from keras_dtensor_fix.engine import patcher, targets
def gate():
    raise RuntimeError("gate exploded")
targets.gate = gate
import keras
print(json.dumps(float(keras.ops.sum(keras.ops.ones((3,))))))
"""
    proc = run_py(code, path=[fakes])
    assert last_json(proc) == 3.0
    assert "gate exploded" in proc.stderr


def test_register_family_rejects_incomplete_modules(run_py) -> None:
    code = """
import json, types
from keras_dtensor_fix.engine import patcher
try:
    patcher.register_family(types.ModuleType("empty"))
except TypeError as exc:
    print(json.dumps(str(exc)))
"""
    out = last_json(run_py(code))
    assert "missing FAMILY, MODULES, patches" in out


STRICT = """
import json
from keras_dtensor_fix.engine import patcher
import fake_family
patcher.register_family(fake_family)
try:
    import fake_target
    print(json.dumps({"raised": None}))
except patcher.PatchError as exc:
    print(json.dumps({"raised": str(exc)}))
"""


@pytest.mark.parametrize("how", ["env", "activate"])
def test_strict_mode_raises_on_a_patch_that_cannot_apply(run_py, fakes, how) -> None:
    """Strict: the import of the patched module fails, naming the target."""
    if how == "env":
        proc = run_py(STRICT, path=[fakes], env={"KERAS_DTENSOR_FIX_STRICT": "1"})
    else:
        code = STRICT.replace(
            "import fake_family", "import fake_family\npatcher.activate(strict=True)"
        )
        proc = run_py(code, path=[fakes])
    out = last_json(proc)
    assert out["raised"] and "fake_target.missing_function not found" in out["raised"]
    # Not strict (the default for users): a warning, and the import works.
    relaxed = last_json(run_py(STRICT, path=[fakes]))
    assert relaxed == {"raised": None}
