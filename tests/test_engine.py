"""The patch engine, on fake families and fake modules; each case in a new
interpreter."""

from __future__ import annotations

import pytest

from support import last_json


@pytest.fixture
def run_py(lenient_run_py):
    return lenient_run_py


# Imports the fakes, records the originals, registers the fake family.
PRELUDE = """
import json, sys, threading
import fake_target, fake_user
import keras_dtensor_fix as kdf
from keras_dtensor_fix.engine import patcher
import fake_family

RAW = {n: fake_target.Base.__dict__[n] for n in ("step", "s", "c")}
ADD = fake_target.add
SUB = fake_target.sub

def rows(family="numpy"):
    return {r["attribute"]: [r["state"], r["reason"]]
            for r in patcher.rows() if r["family"] == family and
            r["module"].startswith("fake")}

def restored():
    return (all(fake_target.Base.__dict__[n] is RAW[n] for n in RAW)
            and fake_target.add is ADD and fake_user.add is ADD
            and fake_target.sub is SUB)

def chains():
    objs = [fake_target.add, fake_user.add]
    objs += [fake_target.Base.__dict__[n] for n in RAW]
    return [patcher.chain_length(o) for o in objs]

patcher.register_family(fake_family)
"""


def test_apply_wraps_everything_and_keeps_semantics(run_py, fakes) -> None:
    code = (
        PRELUDE
        + """
b = fake_target.Base()
print(json.dumps({
    "active": kdf.is_active(),
    "chains": chains(),
    "user_same": fake_user.add is fake_target.add,
    "calls": [fake_target.add(1, 2), fake_user.add(1, 2), b.step(3),
              fake_target.Base.s(4), b.s(4), fake_target.Base.c(5),
              fake_target.Child.c(5), fake_target.Child().step(6),
              fake_target.sub(3, 1)],
    "static": type(fake_target.Base.__dict__["s"].__wrapped__).__name__,
    "original_add": patcher.original("fake_target", "add") is ADD,
    "rows": rows(),
    "after": fake_family.CALLS,
}))
"""
    )
    out = last_json(run_py(code, path=[fakes]))
    assert out["active"]
    assert out["chains"] == [1, 1, 1, 1, 1]
    assert out["user_same"] and out["original_add"]
    assert out["calls"] == [
        ["wrapped", 3],
        ["wrapped", 3],
        ["wrapped", ["step", 3]],
        ["wrapped", ["s", 4]],
        ["wrapped", ["s", 4]],
        ["wrapped", ["c", "Base", 5]],
        ["wrapped", ["c", "Child", 5]],
        ["wrapped", ["step", 6]],
        2,
    ]
    assert out["static"] == "staticmethod"
    rows = out["rows"]
    for name in ("add", "Base.step", "Base.s", "Base.c"):
        assert rows[name][0] == "applied", rows
    assert "fake_user" in rows["add"][1]
    assert rows["Child.step"] == [
        "skipped",
        "inherited from Base; covered by its patch",
    ]
    assert rows["missing_function"][0] == "skipped"
    assert rows["*"] == ["pending", "module not imported yet"]  # fake_late
    assert out["after"] == ["apply"]


def test_deactivate_restores_identity_and_late_hooks_do_nothing(run_py, fakes) -> None:
    code = (
        PRELUDE
        + """
kdf.deactivate()
first = {"restored": restored(), "chains": chains(), "active": kdf.is_active(),
         "rows": rows(), "after": list(fake_family.CALLS)}
import fake_late
late_after_deactivate = patcher.chain_length(fake_late.late)
kdf.activate()
second = {"chains": chains(), "late": patcher.chain_length(fake_late.late),
          "call": fake_late.late()}
kdf.deactivate(); kdf.deactivate()
print(json.dumps({"first": first, "late_off": late_after_deactivate,
                  "second": second, "restored": restored(),
                  "late_restored": patcher.chain_length(fake_late.late),
                  "after": fake_family.CALLS}))
"""
    )
    out = last_json(run_py(code, path=[fakes]))
    first = out["first"]
    assert first["restored"] and first["chains"] == [0] * 5 and not first["active"]
    assert first["rows"]["add"][0] == "reverted"
    assert first["after"] == ["apply", "revert"]
    assert out["late_off"] == 0
    assert out["second"] == {"chains": [1] * 5, "late": 1, "call": ["wrapped", "late"]}
    assert out["restored"] and out["late_restored"] == 0
    assert out["after"] == ["apply", "revert", "apply", "apply", "revert", "revert"]


def test_hook_fires_on_later_import(run_py, fakes) -> None:
    code = """
import json
import keras_dtensor_fix
from keras_dtensor_fix.engine import patcher
import fake_family
patcher.register_family(fake_family)
before = [r["state"] for r in patcher.rows() if r["module"] == "fake_target"]
import fake_target, fake_user
print(json.dumps({"before": before, "add": patcher.chain_length(fake_target.add),
                  "user": fake_user.add is fake_target.add}))
"""
    out = last_json(run_py(code, path=[fakes]))
    assert out == {"before": ["pending"], "add": 1, "user": True}


def test_activate_is_idempotent(run_py, fakes) -> None:
    code = (
        PRELUDE
        + """
before = rows()
for _ in range(3):
    kdf.activate()
    patcher.register_family(fake_family)
    patcher.activate()
print(json.dumps({"chains": chains(), "same_rows": rows() == before,
                  "after": fake_family.CALLS}))
"""
    )
    out = last_json(run_py(code, path=[fakes]))
    assert out == {"chains": [1] * 5, "same_rows": True, "after": ["apply"]}


def test_two_families_on_one_target(run_py, fakes) -> None:
    code = (
        PRELUDE
        + """
import fake_family_data
patcher.register_family(fake_family_data)
print(json.dumps({"chains": chains(), "data_rows": rows("data")}))
"""
    )
    out = last_json(run_py(code, path=[fakes]))
    assert out["chains"] == [1] * 5
    assert out["data_rows"]["add"] == ["skipped", "already patched by family numpy"]


def test_threads_keep_chain_length_one(run_py, fakes) -> None:
    code = (
        PRELUDE
        + """
errors, lengths = [], set()
def worker(first, second):
    try:
        for _ in range(200):
            first(); second()
            lengths.update(chains())
    except Exception as exc:
        errors.append(repr(exc))
threads = [threading.Thread(target=worker, args=(kdf.activate, kdf.deactivate)),
           threading.Thread(target=worker, args=(kdf.deactivate, kdf.activate))]
for t in threads: t.start()
for t in threads: t.join()
kdf.activate(); on = chains()
kdf.deactivate(); off = chains()
print(json.dumps({"errors": errors, "lengths": sorted(lengths), "on": on,
                  "off": off, "restored": restored()}))
"""
    )
    out = last_json(run_py(code, path=[fakes]))
    assert out["errors"] == []
    assert set(out["lengths"]) <= {0, 1}
    assert out["on"] == [1] * 5 and out["off"] == [0] * 5 and out["restored"]


@pytest.mark.parametrize(
    ("disable", "patched"),
    [("numpy", False), ("*", False), (" NUMPY ,data", False), ("optimizers", True)],
)
def test_disable_env_applies_to_families(run_py, fakes, disable, patched) -> None:
    code = PRELUDE + 'print(json.dumps({"chains": chains(), "rows": rows()}))'
    out = last_json(
        run_py(code, path=[fakes], env={"KERAS_DTENSOR_FIX_DISABLE": disable})
    )
    assert out["chains"] == ([1] * 5 if patched else [0] * 5)
    if not patched:
        states = {state for state, _ in out["rows"].values()}
        assert states == {"disabled"}


def test_env_off_still_allows_explicit_activate(run_py, fakes) -> None:
    code = (
        PRELUDE
        + """
off = (kdf.is_active(), chains())
kdf.activate()
print(json.dumps({"off": off, "on": chains(), "active": kdf.is_active()}))
"""
    )
    out = last_json(run_py(code, path=[fakes], env={"KERAS_DTENSOR_FIX": "0"}))
    assert out == {"off": [False, [0] * 5], "on": [1] * 5, "active": True}


def test_family_table_is_the_registry(run_py) -> None:
    """Every row's implementation exports an Implementation; none loads early."""
    code = """
import importlib, json, sys
from keras_dtensor_fix.engine import config, patcher, families
early = sorted(m for m in sys.modules if m.startswith("keras_dtensor_fix.patches."))
found = {}
for row in families.FAMILIES:
    module = importlib.import_module("keras_dtensor_fix.patches." + row.implementation)
    found[row.name] = isinstance(module.IMPLEMENTATION, patcher.Implementation)
print(json.dumps({"early": early, "found": found, "config": list(config.FAMILIES),
                  "engine": patcher.families()}))
"""
    out = last_json(run_py(code))
    assert out["early"] == []  # implementations load with their Keras modules
    assert all(out["found"].values()) and len(out["found"]) >= 13, out["found"]
    assert out["config"] == out["engine"] == list(out["found"])


TRACED_TARGET = """
class Model:
    def scale(self, x):
        return x * 2
"""

TRACED_FAMILY = """
from keras_dtensor_fix.engine.contract import Patch

FAMILY = "data"
MODULES = ("fake_model",)
GATED = False


def plus_one(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs) + 1


def patches(module):
    return [Patch(module.__name__, "Model.scale", plus_one, traced=True)]
"""


def test_traced_method_wrapper_runs_under_torch_compile(run_py, tmp_path) -> None:
    """A ``traced=True`` method patch runs inside compiled code, and reverts."""
    (tmp_path / "fake_model.py").write_text(TRACED_TARGET)
    (tmp_path / "fake_traced.py").write_text(TRACED_FAMILY)
    code = """
import json, torch, fake_model, fake_traced
import keras_dtensor_fix as kdf
from keras_dtensor_fix.engine import patcher

raw = fake_model.Model.__dict__["scale"]
patcher.register_family(fake_traced)
kdf.activate()
entry = fake_model.Model.__dict__["scale"]
model = fake_model.Model()
step = lambda x: model.scale(x)
compiled = torch.compile(step, backend="eager", fullgraph=True)
x = torch.ones(2)
out = {"eager": step(x).tolist(), "compiled": compiled(x).tolist(),
       "fix": patcher.is_fix_wrapper(entry), "chain": patcher.chain_length(entry),
       "name": entry.__name__, "wrapped": entry.__wrapped__ is raw}
kdf.deactivate()
out["restored"] = fake_model.Model.__dict__["scale"] is raw
print(json.dumps(out))
"""
    out = last_json(run_py(code, path=[tmp_path]))
    assert out["eager"] == [3.0, 3.0]
    assert out["compiled"] == [3.0, 3.0], "dynamo skipped the wrapper"
    assert out["fix"] and out["chain"] == 1 and out["name"] == "scale"
    assert out["wrapped"] and out["restored"]


ADDED_FAMILY = """
from keras_dtensor_fix.engine.contract import Patch

FAMILY = "layouts"
MODULES = ("fake_target",)
GATED = False


def extra(cls):
    return ("extra", cls.__name__)


def patches(module):
    return [
        Patch(module.__name__, "Base.extra", classmethod(extra), added=True),
        Patch(module.__name__, "Base.step", classmethod(extra), added=True),
    ]
"""


def test_added_patch_is_applied_kept_off_an_own_and_deleted(run_py, fakes) -> None:
    """``Patch(added=True)``: an attribute the target lacks is installed as
    it is (an applied row), one the target has is left alone, and
    deactivation deletes what was added."""
    (fakes / "added_family.py").write_text(ADDED_FAMILY)
    code = """
import json
import fake_target
import keras_dtensor_fix as kdf
from keras_dtensor_fix.engine import patcher
import added_family

own_step = fake_target.Base.__dict__["step"]
patcher.register_family(added_family)
rows = {r["attribute"]: r["state"] for r in patcher.rows()
        if r["family"] == "layouts" and r["module"] == "fake_target"}
on = {"extra": fake_target.Child.extra(), "rows": rows,
      "step_kept": fake_target.Base.__dict__["step"] is own_step}
kdf.deactivate()
print(json.dumps({"on": on, "off": hasattr(fake_target.Base, "extra"),
                  "step_after": fake_target.Base.__dict__["step"] is own_step}))
"""
    out = last_json(run_py(code, path=[fakes]))
    assert out["on"]["extra"] == ["extra", "Child"]
    assert out["on"]["rows"] == {"Base.extra": "applied", "Base.step": "skipped"}
    assert out["on"]["step_kept"] and out["step_after"]
    assert out["off"] is False


def test_keras_object_takes_the_layout_found(monkeypatch) -> None:
    """An object whose module moved between Keras's layouts names a module per
    layout: the first one found is imported (``get_device``: ``ops/core.py``
    from about 2026-10, ``core.py`` before)."""
    import json

    from keras_dtensor_fix.engine import targets

    monkeypatch.setitem(
        targets.OBJECTS, "probe", (("kdf_no_such_layout.core", "json"), "dumps")
    )
    monkeypatch.setattr(targets, "_FOUND", {})  # looked up afresh, then dropped
    assert targets.keras_object("probe") is json.dumps
