"""The engine on real Keras modules: the gate, keras.ops, identity on revert."""

from __future__ import annotations

import pytest

from support import FAKE_DATA_FAMILY, last_json

# A gated fake family that counts calls through torch numpy add/subtract,
# and one that wraps distribute_data_input (also bound in the trainer).
COUNTING = """
from keras_dtensor_fix.engine.contract import Patch
from keras_dtensor_fix.engine.targets import torch_module
FAMILY = "fakeops"
MODULES = torch_module("numpy")
CALLS = []
def count(wrapped, instance, args, kwargs):
    CALLS.append(wrapped.__name__)
    return wrapped(*args, **kwargs)
def patches(module):
    return [Patch(module.__name__, name, count) for name in ("add", "subtract")]
"""

DATA = FAKE_DATA_FAMILY


@pytest.fixture
def keras_fakes(tmp_path):
    (tmp_path / "counting_family.py").write_text(COUNTING)
    (tmp_path / "fake_data_family.py").write_text(DATA)
    return tmp_path


def test_keras_ops_calls_the_patched_attribute(run_py, keras_fakes) -> None:
    code = """
import json
from keras_dtensor_fix.engine import patcher
import counting_family
patcher.register_family(counting_family)
import keras
a = keras.ops.ones((2,))
keras.ops.add(a, a); keras.ops.subtract(a, a); (a + a)
seen = list(counting_family.CALLS)
patcher.deactivate()
keras.ops.add(a, a)
print(json.dumps({"seen": seen, "after": counting_family.CALLS}))
"""
    proc = run_py(code, path=[keras_fakes], env={"KERAS_DTENSOR_FIX_DISABLE": "numpy"})
    out = last_json(proc)
    assert out["seen"][:2] == ["add", "subtract"]
    assert out["after"] == out["seen"]


def test_distribute_data_input_wrapped_in_module_and_trainer(
    run_py, keras_fakes
) -> None:
    code = """
import json
from keras_dtensor_fix.engine import patcher
import fake_data_family
patcher.register_family(fake_data_family)
import keras
from keras.src.backend.torch import distribution_lib as dl, trainer
module, name = "keras.src.backend.torch.distribution_lib", "distribute_data_input"
original = patcher.original(module, name)
state = {"chain": patcher.chain_length(dl.distribute_data_input),
         "trainer_same": trainer.distribute_data_input is dl.distribute_data_input,
         "row": [r["state"] for r in patcher.rows()
                 if r["module"] == module and r["attribute"] == name]}
patcher.deactivate()
state["restored"] = (dl.distribute_data_input is original
                     and trainer.distribute_data_input is original
                     and patcher.chain_length(original) == 0)
print(json.dumps(state))
"""
    out = last_json(run_py(code, path=[keras_fakes]))
    assert out["chain"] == 1 and out["trainer_same"] and out["restored"]
    assert "applied" in out["row"]


REAL = """
import importlib, json, sys
import keras
from keras_dtensor_fix.engine import patcher
try:
    importlib.import_module("keras.src.backend.torch.optimizers.torch_adam")
    importlib.import_module("keras.src.backend.torch.optimizers.torch_adamw")
except ImportError:
    pass

def resolve(module, attribute):
    obj = sys.modules[module]
    *path, name = attribute.split(".")
    for part in path:
        obj = getattr(obj, part)
    return obj.__dict__[name] if isinstance(obj, type) else getattr(obj, name)

applied = [r for r in patcher.rows() if r["state"] == "applied"]
originals = {(r["module"], r["attribute"]):
             patcher.original(r["module"], r["attribute"]) for r in applied}
also = {}
for (module, attribute), original in originals.items():
    for other, mod in list(sys.modules.items()):
        if other.startswith("keras.") and "." not in attribute and \\
                getattr(mod, attribute, None) is resolve(module, attribute):
            also.setdefault((module, attribute), []).append(other)
chains = {f"{m}:{a}": patcher.chain_length(resolve(m, a)) for m, a in originals}
patcher.deactivate()
restored = {f"{m}:{a}": resolve(m, a) is o for (m, a), o in originals.items()}
also_restored = all(getattr(sys.modules[o], a) is originals[(m, a)]
                    for (m, a), others in also.items() for o in others)
rows = {f"{r['family']}|{r['module']}:{r['attribute']}": r["state"]
        for r in patcher.rows()}
print(json.dumps({"chains": chains, "restored": restored, "rows": rows,
                  "also_restored": also_restored, "n_also": len(also)}))
"""

EXPECTED = {
    "numpy_ops": [("ops.numpy", "add"), ("ops.numpy", "subtract")],
    "data": [("distribution_lib", "distribute_data_input")],
    "promotion": [("distribution_lib", "activate_dtensor_promotion")],
    "optimizers": [("optimizers.torch_adam", "Adam._parallel_update_step")],
}


def test_real_families_patch_and_deactivate_restores_identity(run_py) -> None:
    out = last_json(run_py(REAL))
    assert all(length == 1 for length in out["chains"].values()), out["chains"]
    assert all(out["restored"].values()), out["restored"]
    assert out["also_restored"]
    assert "applied" not in out["rows"].values()


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_real_family_targets_applied_after_import_keras(run_py, family) -> None:
    out = last_json(run_py(REAL))
    for module, attribute in EXPECTED[family]:
        key = f"keras.src.backend.torch.{module}:{attribute}"
        assert out["chains"].get(key) == 1, sorted(out["chains"])
        assert out["restored"][key]


NON_TORCH = """
import json, sys
from keras_dtensor_fix.engine import patcher
import counting_family
patcher.register_family(counting_family)
import keras
import keras_dtensor_fix as kdf
s = kdf.status()
print(json.dumps({"backend": s["backend"], "gate": s["gate"],
    "applied": [r for r in s["targets"] if r["state"] == "applied"],
    # restarts: torch's own rendezvous, fixed whatever Keras's backend
    "states": sorted({r["state"] for r in s["targets"] if r["family"] != "restarts"}),
    "torch_backend_loaded": any(m.startswith("keras.src.backend.torch.")
                                for m in sys.modules),
    "value": float(keras.ops.sum(keras.ops.ones((2,))))}))
"""


@pytest.mark.jax
def test_numpy_backend_patches_nothing(run_py, keras_fakes) -> None:
    proc = run_py(NON_TORCH, path=[keras_fakes], env={"KERAS_BACKEND": "numpy"})
    out = last_json(proc)
    assert out["backend"] == "numpy" and out["value"] == 2.0
    assert out["gate"]["ok"] is False and "'numpy'" in out["gate"]["reason"]
    assert out["applied"] == [] and "pending" not in out["states"]


@pytest.mark.jax
def test_maybe_and_numpy_backend_import_keras(run_py) -> None:
    proc = run_py(
        "import keras; print(keras.ops.sum(keras.ops.ones((2,))))",
        env={"KERAS_BACKEND": "numpy", "KERAS_DTENSOR_FIX": "maybe"},
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("2.0")


# A Keras without torch distribution support, like stable keras 3.15.1.
FAKE_KERAS = {
    "keras/__init__.py": "from keras.src.backend import config\n",
    "keras/src/__init__.py": "",
    "keras/src/backend/__init__.py": "from keras.src.backend import config\n",
    "keras/src/backend/config.py": "def backend():\n    return 'torch'\n",
    "keras/src/backend/torch/__init__.py": "from . import numpy\n",
    "keras/src/backend/torch/numpy.py": "def add(a, b):\n    return a + b\n",
}


def test_keras_without_torch_distribution_is_not_patched(run_py, tmp_path) -> None:
    for name, text in FAKE_KERAS.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (tmp_path / "counting_family.py").write_text(COUNTING)
    code = """
import json
from keras_dtensor_fix.engine import patcher
import counting_family
patcher.register_family(counting_family)
import keras, keras.src.backend.torch.numpy as tnp
s = patcher.state()
print(json.dumps({"gate": s["gate"], "chain": patcher.chain_length(tnp.add),
    "applied": [r for r in s["targets"] if r["state"] == "applied"],
    "fake": [r for r in s["targets"] if r["family"] == "fakeops"]}))
"""
    out = last_json(run_py(code, path=[tmp_path]))
    assert out["gate"]["ok"] is False
    assert "no torch distribution support" in out["gate"]["reason"]
    assert out["chain"] == 0 and out["applied"] == []
    assert all(r["state"] == "skipped" for r in out["fake"]), out["fake"]


UNDO = """
import json, os, sys
import keras, numpy as np, torch.distributed as dist
import keras_dtensor_fix
from keras_dtensor_fix.patches import variables

store = "file://" + sys.argv[1]
dist.init_process_group("gloo", init_method=store, rank=0, world_size=1)
devices = keras.distribution.list_devices()[:1]
mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
)
model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse", jit_compile=True)
model.make_train_function()
layout = model.layers[0].kernel._layout
before = {
    "spec": hasattr(layout, variables.SPEC),
    "mesh": "_backend_mesh" in vars(mesh),
    "train_function": "train_function" in vars(model),
    "static": getattr(model.train_function, "_keras_dtensor_fix_static", False),
}
keras_dtensor_fix.deactivate()
after = {
    "spec": hasattr(layout, variables.SPEC),
    "mesh": "_backend_mesh" in vars(mesh),
    "static": getattr(
        getattr(model, "train_function", None), "_keras_dtensor_fix_static", False
    ),
}
dist.destroy_process_group()
print(json.dumps({"before": before, "after": after}))
"""


def test_deactivate_undoes_attributes_set_on_keras_objects(run_py, tmp_path) -> None:
    """A variable's cached layout spec, the mesh's torch mesh and the compiled
    step's static-shape wrapper are set on Keras objects; deactivate() removes
    each (or puts back what was there)."""
    out = last_json(run_py(UNDO, argv=[str(tmp_path / "store")]))
    before, after = out["before"], out["after"]
    assert before["spec"] and before["static"], before
    assert after == {"spec": False, "mesh": False, "static": False}, after


FALLBACK = """
import json, sys, warnings
import keras, numpy as np, torch, torch.distributed as dist
import torch._inductor.compile_fx as inductor
import keras_dtensor_fix
from keras_dtensor_fix.compiled import fallback

def broken_backend(*args, **kwargs):
    raise RuntimeError("inductor is broken here")

inductor.compile_fx = broken_backend
if sys.argv[2] == "off":
    fallback.eager_if_compile_fails = lambda function, instance, make: function
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0,
                        world_size=1)
mesh = keras.distribution.DeviceMesh(
    (1, 1), ["batch", "model"], keras.distribution.list_devices()[:1])
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch"))
model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
model.compile(optimizer="sgd", loss="mse", jit_compile=True)
x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
out = {}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        out["losses"] = model.fit(x, y, epochs=2, verbose=0).history["loss"]
    except Exception as err:
        out["error"] = type(err).__name__
out["warnings"] = [
    str(w.message) for w in caught
    if "keras-dtensor-fix" in str(w.message) or "keras_dtensor_fix" in str(w.message)
]
dist.destroy_process_group()
print(json.dumps(out))
"""


@pytest.mark.parametrize("fallback", ["on", "off"])
def test_compile_failure_runs_eagerly(run_py, tmp_path, fallback) -> None:
    """A ModelParallel step that torch.compile fails on (here: a broken
    inductor) is rebuilt eagerly once, with one warning, and trains; without
    the fallback fit() raises. Upstream never compiles these steps."""
    out = last_json(run_py(FALLBACK, argv=[str(tmp_path / "store"), fallback]))
    if fallback == "off":
        assert out["error"] == "BackendCompilerFailed", out
        return
    assert len(out["losses"]) == 2 and "error" not in out, out
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "torch.compile failed" in out["warnings"][0]
