"""activate()/deactivate() racing each other, Keras's import, and a model build.

``test_engine.py`` covers two threads toggling on fake families. Here it is
the real families on real Keras: after every race each patched object
(wherever Keras bound it) carries exactly one wrapper while active, none
after ``deactivate()``, the originals come back by identity, and the applied
targets are those of an ordinary ``import keras``: none lost, none doubled.
Each case runs in a fresh interpreter.
"""

from __future__ import annotations

import pytest

from support import last_json

# Helpers run in the fresh interpreter: every value bound in Keras's torch
# backend modules and in the classes they define.
COMMON = """
import importlib, json, sys, threading
import keras_dtensor_fix as kdf
from keras_dtensor_fix.engine import patcher, targets

def backend_module(kind):  # "keras.src.backend.torch[.ops].<kind>", either layout
    return importlib.import_module(
        next(m for m in targets.torch_module(kind) if targets.find_spec(m)))

def namespaces():
    for name, module in list(sys.modules.items()):
        if module is None or not name.startswith("keras.src.backend.torch"):
            continue
        yield name, dict(vars(module))
        for attr, value in list(vars(module).items()):
            if isinstance(value, type) and value.__module__ == name:
                yield f"{name}.{attr}", dict(vars(value))

def snapshot():
    return {(owner, key): value
            for owner, space in namespaces() for key, value in space.items()}

def wrapped():
    found = {}
    for (owner, key), value in snapshot().items():
        if patcher.is_fix_wrapper(value):
            found[f"{owner}.{key}"] = patcher.chain_length(value)
    return found

def applied():
    return sorted(f"{r['family']}|{r['module']}|{r['attribute']}"
                  for r in patcher.rows() if r["state"] == "applied")

def report(**extra):
    tnp = backend_module("numpy")
    on = {"active": kdf.is_active(), "add": patcher.chain_length(tnp.add),
          "applied": applied(), "wrapped": wrapped(), "warnings": patcher._warnings}
    kdf.deactivate()
    off = {"add": patcher.chain_length(tnp.add), "wrapped": wrapped()}
    return {"on": on, "off": off, **extra}
"""

REFERENCE = (
    COMMON
    + """
import keras
print(json.dumps(report()))
"""
)
_REFERENCE: dict = {}


@pytest.fixture
def reference(run_py) -> dict:
    """What an ordinary ``import keras`` with the plugin on applies (run once)."""
    if not _REFERENCE:
        _REFERENCE.update(last_json(run_py(REFERENCE)))
    assert len(_REFERENCE["on"]["applied"]) > 100, _REFERENCE["on"]["applied"]
    return _REFERENCE


def assert_clean(out: dict, reference: dict) -> None:
    """One wrapper per patched object while on, none when off, none lost."""
    on, off = out["on"], out["off"]
    assert on["active"] and on["add"] == 1
    missing = sorted(set(reference["on"]["applied"]) - set(on["applied"]))
    assert missing == [], missing
    assert on["applied"] == reference["on"]["applied"]
    assert on["wrapped"] and set(on["wrapped"].values()) == {1}, on["wrapped"]
    # Every copy Keras bound (``from .numpy import add`` elsewhere) too.
    assert set(on["wrapped"]) == set(reference["on"]["wrapped"])
    assert off == {"add": 0, "wrapped": {}}


THREADS = (
    COMMON
    + """
import keras
tnp = backend_module("numpy")
kdf.activate(); kdf.deactivate()  # activation imports the torch optimizers
before = snapshot()
errors, lengths = [], set()
stop = threading.Event()
x = keras.ops.ones((4,))

def toggle(first, second):
    try:
        for _ in range(40):
            first(); second()
            lengths.add(patcher.chain_length(tnp.add))
    except Exception as exc:
        errors.append(repr(exc))

def use():
    try:
        while not stop.is_set():
            assert float(keras.ops.sum(keras.ops.add(x, x))) == 8.0
    except Exception as exc:
        errors.append(repr(exc))

user = threading.Thread(target=use)
threads = [threading.Thread(target=toggle, args=(kdf.activate, kdf.deactivate)),
           threading.Thread(target=toggle, args=(kdf.deactivate, kdf.activate))]
user.start()
for t in threads: t.start()
for t in threads: t.join()
stop.set(); user.join()
kdf.activate()
out = report(errors=errors, lengths=sorted(lengths))
now = snapshot()
out["changed"] = sorted(
    f"{o}.{k}" for (o, k), v in before.items() if now.get((o, k)) is not v)
print(json.dumps(out))
"""
)


def test_two_threads_toggling_on_real_keras(run_py, reference) -> None:
    out = last_json(run_py(THREADS))
    assert out["errors"] == []
    assert set(out["lengths"]) <= {0, 1}, out["lengths"]
    assert_clean(out, reference)
    assert out["on"]["warnings"] == []
    # deactivate() put back the very objects that were there before.
    assert out["changed"] == []


HOOK = (
    COMMON
    + """
import wrapt
STEPS = STEPS_HERE
seen = []

def during_import(module):
    for step in STEPS:
        getattr(kdf, step)()
    seen.append(kdf.is_active())

for name in targets.torch_module("numpy"):  # only one of them exists
    wrapt.register_post_import_hook(during_import, name)
import keras
half = list(seen)
if not kdf.is_active():
    kdf.activate()
# Modules still half imported at activate() are patched at a later import hook;
# building an optimizer imports the torch optimizer modules (as training does).
keras.optimizers.Adam()
print(json.dumps(report(half=half)))
"""
)


@pytest.mark.parametrize(
    ("start", "steps"),
    [
        # On from start-up; re-entered while Keras is half imported.
        ("1", ("activate", "deactivate", "activate")),
        # Off at start-up; first activated from inside an import hook.
        ("0", ("activate",)),
        # Switched off half-way through the import, on again after it.
        ("1", ("deactivate",)),
        ("1", ("deactivate", "activate", "deactivate")),
    ],
)
def test_toggle_while_keras_is_half_imported(run_py, reference, start, steps) -> None:
    proc = run_py(
        HOOK.replace("STEPS_HERE", repr(list(steps))), env={"KERAS_DTENSOR_FIX": start}
    )
    out = last_json(proc)
    assert out["half"] == [steps[-1] == "activate"], out["half"]
    assert_clean(out, reference)


BUILD = (
    COMMON
    + """
import tempfile
import numpy as np
import torch, torch.distributed as dist
import keras
from keras_dtensor_fix.patches import promotion

dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(),
                        rank=0, world_size=1)
mesh = keras.distribution.DeviceMesh((1,), ["model"], keras.distribution.list_devices())
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*dense_a/kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map))
events = []

class Toggling(keras.layers.Layer):
    def build(self, input_shape):
        kdf.deactivate()
        events.append(["off", kdf.is_active(), len(promotion.promotion_modes())])
        self.w = self.add_weight(shape=(input_shape[-1],), initializer="ones",
                                 name="w")
        kdf.activate()
        events.append(["on", kdf.is_active(), len(promotion.promotion_modes())])

    def call(self, x):
        return keras.ops.multiply(x, self.w)

model = keras.Sequential([keras.layers.Input((4,)),
                          keras.layers.Dense(8, name="dense_a"),
                          Toggling(name="toggle"),
                          keras.layers.Dense(2, name="dense_b")])
x = np.random.default_rng(0).normal(size=(3, 4)).astype("float32")
got = keras.ops.convert_to_numpy(model(x))
ka, ba, w, kb, bb = model.get_weights()
want = ((x @ ka + ba) * w) @ kb + bb
kernel = model.layers[0].kernel.value
out = report(events=events, modes=len(promotion.promotion_modes()),
             close=bool(np.allclose(got, want, atol=1e-5)),
             kernel=[type(kernel).__name__, [str(p) for p in kernel.placements]])
dist.destroy_process_group()
print(json.dumps(out))
"""
)


def test_toggle_inside_a_layer_build(run_py, reference) -> None:
    out = last_json(run_py(BUILD))
    # Off: Keras's own promotion mode is back (a ModelParallel is set); on
    # again: the plugin has taken it off the dispatch stack once more.
    assert out["events"] == [["off", False, 1], ["on", True, 0]]
    assert out["modes"] == 0
    assert out["kernel"][0] == "DTensor"
    assert out["close"]
    assert_clean(out, reference)
    assert out["on"]["warnings"] == []
