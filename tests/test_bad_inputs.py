"""Odd environments: nothing raises at import; each gets a one-line warning or status.

Each case runs in a fresh interpreter. What ``test_config.py`` and
``test_keras.py`` already cover (every accepted or garbage value of
``KERAS_DTENSOR_FIX`` parsed, ``numpy,bogus``, the numpy backend, a Keras
without torch distribution support) is not repeated here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support import last_json

STATUS = """
import importlib, json
import keras
import keras_dtensor_fix as kdf
from keras_dtensor_fix.engine import patcher, targets
tnp = importlib.import_module(
    next(m for m in targets.torch_module("numpy") if targets.find_spec(m)))
s = kdf.status()
print(json.dumps({
    "active": s["enabled"], "why": s["why"],
    "disabled": s["disabled_families"], "warnings": s["warnings"],
    "add": patcher.chain_length(tnp.add),
    "numpy": sorted({r["state"] for r in s["targets"] if r["family"] == "numpy"}),
    "applied": sorted({r["family"] for r in s["targets"] if r["state"] == "applied"}),
}))
"""


def one_line(text: str) -> bool:
    return bool(text.strip()) and "\n" not in text and "\r" not in text


@pytest.mark.parametrize(
    ("enable", "disable", "disabled", "warned"),
    [
        # Mixed case and spaces on both; an unknown family among empty items.
        (" On ", " , NUMPY ,bogus, ", ["numpy"], "bogus"),
        # A newline inside the value: still one warning line (repr escapes it).
        ("on\noff", "", [], "not understood"),
        # Empty values are the defaults, silently.
        ("", "", [], None),
    ],
)
def test_environment_values(run_py, enable, disable, disabled, warned) -> None:
    env = {"KERAS_DTENSOR_FIX": enable, "KERAS_DTENSOR_FIX_DISABLE": disable}
    proc = run_py(STATUS, env=env)
    out = last_json(proc)
    assert out["active"], out
    assert out["disabled"] == disabled
    if disabled:
        assert out["add"] == 0 and out["numpy"] == ["disabled"]
    else:
        assert out["add"] == 1 and "applied" in out["numpy"]
    assert "variables" in out["applied"] and "data" in out["applied"]
    if warned is None:
        assert out["warnings"] == [] and "Warning" not in proc.stderr
    else:
        (warning,) = out["warnings"]
        assert warned in warning and one_line(warning), warning
        assert proc.stderr.count(warning) == 1, proc.stderr


# Keras moved or removed things the families patch: simulated after ``import
# keras`` with the plugin off, then activated.
MOVED = """
import importlib, json
import keras
from keras_dtensor_fix.engine import targets
trainer_class = targets.trainer_class
def backend_module(kind):
    return importlib.import_module(
        next(m for m in targets.torch_module(kind) if targets.find_spec(m)))
tnp, core = backend_module("numpy"), backend_module("core")
distribution_lib = importlib.import_module(targets.DISTRIBUTION_LIB)
trainer = importlib.import_module(targets.TRAINER)
SUBTRACT = tnp.subtract
del tnp.add                                          # numpy op gone
del core.Variable._initialize_distributed            # variables family target
del distribution_lib.activate_dtensor_promotion      # promotion family target
cls = getattr(trainer, trainer_class(trainer))       # compile family target
if "_use_torch_compile" in vars(cls):
    cls._use_torch_compile_renamed = cls.__dict__["_use_torch_compile"]
    del cls._use_torch_compile

import keras_dtensor_fix as kdf
from keras_dtensor_fix.engine import patcher
kdf.activate()
s = kdf.status()
x = keras.ops.ones((2, 3))
out = {
    "active": s["enabled"],
    "warnings": s["warnings"],
    "rows": s["targets"],
    "numpy": tnp.__name__, "core": core.__name__, "trainer": cls.__name__,
    "subtract": patcher.chain_length(tnp.subtract),
    "value": float(keras.ops.sum(keras.ops.subtract(x, 1.0))),
}
kdf.deactivate()
out["restored"] = tnp.subtract is SUBTRACT
print(json.dumps(out))
"""


def test_keras_targets_moved(run_py) -> None:
    # Not strict: this is what a user sees (strict mode would raise).
    proc = run_py(
        MOVED, env={"KERAS_DTENSOR_FIX": "0", "KERAS_DTENSOR_FIX_STRICT": None}
    )
    out = last_json(proc)
    assert out["active"] and out["value"] == 0.0
    assert out["subtract"] == 1 and out["restored"]
    rows = out["rows"]
    for row in rows:
        assert one_line(row["reason"]), row

    def reasons(family: str, module: str) -> list[str]:
        return [
            r["reason"]
            for r in rows
            if r["family"] == family
            and r["module"] == module
            and r["state"] == "skipped"
        ]

    variables = reasons("variables", out["core"])
    assert any("_initialize_distributed not found" in r for r in variables), rows
    promotion = reasons("promotion", "keras.src.backend.torch.distribution_lib")
    assert any("activate_dtensor_promotion not found" in r for r in promotion), rows
    # Nothing claims to have wrapped what is not there.
    applied = {(r["module"], r["attribute"]) for r in rows if r["state"] == "applied"}
    assert (out["numpy"], "add") not in applied
    compile_target = f"{out['trainer']}._use_torch_compile"
    assert ("keras.src.backend.torch.trainer", compile_target) not in applied
    assert (out["numpy"], "subtract") in applied
    # Each failing family said so, in one line, in the status warnings.
    assert out["warnings"], proc.stderr
    for warning in out["warnings"]:
        assert one_line(warning), warning
    assert any("variables" in w for w in out["warnings"])


NON_TORCH = """
import json, sys
import keras
import keras_dtensor_fix as kdf
s = kdf.status()
print(json.dumps({"backend": s["backend"], "gate": s["gate"],
    "states": sorted({r["state"] for r in s["targets"] if r["family"] != "restarts"}),
    "restarts": sorted({r["state"] for r in s["targets"] if r["family"] == "restarts"}),
    "warnings": s["warnings"],
    "torch_backend": [m for m in sys.modules
                      if m.startswith("keras.src.backend.torch")],
    "value": float(keras.ops.sum(keras.ops.ones((2,))))}))
"""


@pytest.mark.jax
def test_jax_backend(run_py) -> None:
    out = last_json(run_py(NON_TORCH, env={"KERAS_BACKEND": "jax"}))
    assert out["backend"] == "jax" and out["value"] == 2.0
    assert out["gate"]["ok"] is False and "'jax'" in out["gate"]["reason"]
    assert one_line(out["gate"]["reason"])
    assert out["states"] == ["skipped"] and out["warnings"] == []
    # torch's own rendezvous is fixed whatever Keras's backend (it is not
    # imported here: pending).
    assert out["restarts"] == ["pending"]
    assert out["torch_backend"] == []


NO_KERAS = """
import json, sys
import keras_dtensor_fix as kdf     # -S: no .pth ran; this import boots it
try:
    import keras
except ImportError as exc:
    error = repr(exc)
kdf.activate(); kdf.deactivate(); kdf.activate()
s = kdf.status()
print(json.dumps({"error": error, "active": s["enabled"], "keras": s["keras"],
    "torch": s["torch"], "layout": s["layout"], "gate": s["gate"],
    "warnings": s["warnings"], "rows": s["targets"],
    "heavy": sorted(m for m in sys.modules if m.split(".")[0] in
                    ("keras", "torch", "numpy"))}))
"""


def test_keras_not_installed(run_py, tmp_path) -> None:
    """An interpreter with wrapt and the plugin only: no Keras, torch or numpy."""
    import wrapt

    site = Path(wrapt.__file__).resolve().parents[1]
    for entry in site.iterdir():
        if entry.name == "wrapt" or (
            entry.name.startswith("wrapt-") and entry.name.endswith(".dist-info")
        ):
            (tmp_path / entry.name).symlink_to(entry)
    out = last_json(run_py(NO_KERAS, args=["-S"], path=[tmp_path]))
    assert "No module named 'keras'" in out["error"]
    assert out["active"] and out["warnings"] == []
    assert out["keras"] == {"version": None, "distribution": None}
    assert out["torch"] == {"version": None}
    assert out["layout"] is None
    assert out["gate"] == {"ok": None, "reason": "Keras is not imported yet"}
    assert {r["state"] for r in out["rows"]} == {"pending"}
    assert all(one_line(r["reason"]) for r in out["rows"])
    assert out["heavy"] == []


BLOCKED = """
import json, sys
sys.modules["keras"] = None
import keras_dtensor_fix as kdf
try:
    import keras
except ImportError as exc:
    error = repr(exc)
kdf.activate(); kdf.deactivate(); kdf.activate()
s = kdf.status()
print(json.dumps({"error": error, "active": s["enabled"], "gate": s["gate"],
    "warnings": s["warnings"], "rows": s["targets"]}))
"""


def test_keras_blocked_in_sys_modules(run_py) -> None:
    out = last_json(run_py(BLOCKED))
    assert "keras" in out["error"] and "keras_dtensor_fix" not in out["error"]
    assert out["active"] and out["warnings"] == []
    assert out["gate"] == {"ok": None, "reason": "Keras is not imported yet"}
    # Rows say "pending" or "skipped" (a None entry reads as a Keras without
    # those modules), each with a one-line reason; none is applied.
    assert {r["state"] for r in out["rows"]} <= {"pending", "skipped"}
    assert all(one_line(r["reason"]) for r in out["rows"])


BROKEN_KERAS = """
import json
errors = []
for _ in range(2):
    try:
        import keras
    except ImportError as exc:
        errors.append(repr(exc))
import keras_dtensor_fix as kdf
s = kdf.status()
print(json.dumps({"errors": errors, "active": s["enabled"], "warnings": s["warnings"],
    "states": sorted({r["state"] for r in s["targets"]})}))
"""


def test_keras_that_fails_to_import(run_py, tmp_path) -> None:
    """The user's ImportError comes through unchanged, every time."""
    (tmp_path / "keras").mkdir()
    (tmp_path / "keras" / "__init__.py").write_text(
        'raise ImportError("keras is not installed here (test stub)")\n'
    )
    out = last_json(run_py(BROKEN_KERAS, path=[tmp_path]))
    stub = "ImportError('keras is not installed here (test stub)')"
    assert out["errors"] == [stub, stub]
    assert out["active"] and out["warnings"] == [] and out["states"] == ["pending"]
    proc = run_py(
        module="keras_dtensor_fix", argv=["status", "--json"], path=[tmp_path]
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    note = "import keras failed: ImportError: keras is not installed here (test stub)"
    assert note in report["notes"]
    assert all(one_line(n) for n in report["notes"])


OLD_WRAPT = """
import json, os, sys
import wrapt
if sys.argv[1] == "version":
    wrapt.__version__ = "1.14.1"
else:
    del wrapt.register_post_import_hook
os.environ["KERAS_DTENSOR_FIX"] = "1"  # as if set at start-up
from keras_dtensor_fix import _bootstrap
_bootstrap.boot()                      # what importing the package runs
import keras_dtensor_fix as kdf
kdf.activate()                         # an explicit call: same answer
import importlib, keras
from keras_dtensor_fix.engine import patcher, targets
tnp = importlib.import_module(
    next(m for m in targets.torch_module("numpy") if targets.find_spec(m)))
s = kdf.status()
print(json.dumps({"active": kdf.is_active(), "enabled": s["enabled"],
    "why": s["why"], "warnings": s["warnings"],
    "add": patcher.chain_length(tnp.add),
    "applied": [r for r in s["targets"] if r["state"] == "applied"]}))
"""


@pytest.mark.parametrize(
    ("mode", "found"),
    [("version", "found 1.14.1"), ("hook", "without register_post_import_hook")],
)
def test_wrapt_too_old(run_py, mode, found) -> None:
    # The plugin is off at start so that wrapt is not imported before the edit.
    proc = run_py(OLD_WRAPT, argv=[mode], env={"KERAS_DTENSOR_FIX": "0"})
    out = last_json(proc)
    assert not out["active"] and not out["enabled"]
    assert out["add"] == 0 and out["applied"] == []
    (warning,) = out["warnings"]
    assert warning.startswith("keras-dtensor-fix needs wrapt>=2 (")
    assert found in warning and warning.endswith("; not activated")
    assert one_line(warning) and out["why"] == warning
    assert proc.stderr.count(warning) == 1, proc.stderr
    assert "Traceback" not in proc.stderr


OLD_TORCH = """
import json, types, warnings
import torch
import keras
import keras_dtensor_fix as kdf
from keras_dtensor_fix.patches import compile as compile_patch
compile_patch.model_parallel = lambda: object()    # as if ModelParallel were set
from keras.src.backend.torch import trainer
model = types.SimpleNamespace(jit_compile=True, run_eagerly=False, name="model",
                              _flatten_layers=lambda **kwargs: [])
cls = getattr(trainer, "Trainer", None) or trainer.TorchTrainer
out = {"nightly_compiles": "_use_torch_compile" in vars(cls),
       "installed": torch.__version__}
for version in ("2.11.0+cu130", "2.12.0", "2.13.0+cpu", torch.__version__):
    torch.__version__ = version
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiles = compile_patch._use_torch_compile(
            lambda: "upstream", model, (), {})
    out[version] = {"compiles": compiles, "notes": kdf.status()["notes"],
                    "warnings": [str(w.message) for w in caught]}
print(json.dumps(out))
"""


def test_torch_too_old_to_compile(run_py) -> None:
    """Before torch 2.12 a compiled ModelParallel step fails in dynamo: run eagerly."""
    out = last_json(run_py(OLD_TORCH))
    old = out["2.11.0+cu130"]
    assert old["compiles"] is False
    (warning,) = old["warnings"]
    assert "torch 2.11.0+cu130" in warning and "torch>=2.12" in warning, warning
    if out["nightly_compiles"]:
        assert any("torch 2.11.0+cu130" in note for note in old["notes"]), old
    else:  # an early nightly's own note comes first, whatever the torch
        assert any("on this keras-nightly" in note for note in old["notes"]), old
    # The torch installed (every torch of `nox -s matrix`) compiles too.
    for version in ("2.12.0", "2.13.0+cpu", out["installed"]):
        new = out[version]
        assert new["compiles"] is True and new["warnings"] == [], new
        assert not any("torch>=2.12" in note for note in new["notes"]), new
