"""``KERAS_DTENSOR_FIX_COMPILE=blocks`` without processes: the mode's
parsing, which layers are blocks, and that deactivation takes the regions
back. The compiled regions themselves run in ``multiprocess/test_blocks.py``."""

from __future__ import annotations

import warnings

import pytest

from keras_dtensor_fix.engine import config
from support import BLOCK, last_json


@pytest.mark.parametrize(
    ("raw", "mode"),
    [(None, "auto"), ("", "auto"), (" Blocks ", "blocks"), ("step", "step")],
)
def test_compile_mode(raw: str | None, mode: str) -> None:
    env = {} if raw is None else {config.ENV_COMPILE: raw}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config.compile_mode(env) == mode


def test_compile_mode_not_understood_warns() -> None:
    with pytest.warns(UserWarning, match="accepted values are auto, step, blocks"):
        assert config.compile_mode({config.ENV_COMPILE: "layers"}) == "auto"


REPEATED = r"""
import json, os
os.environ["KERAS_BACKEND"] = "torch"
import keras
from keras import layers
import keras_dtensor_fix as kdf
from keras_dtensor_fix.compiled import blocks, plan

{BLOCK}

class Single(layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.dense = layers.Dense(4)
    def call(self, x):
        return self.dense(x)

inputs = keras.Input((4,))
x = Block(name="b0")(inputs)
x = Single(name="s")(x)        # one of its class: no block
x = Block(name="b1")(x)
x = layers.Dense(4, name="head")(x)   # no sublayers: no block
model = keras.Model(inputs, x)
found = [layer.name for layer in blocks.repeated(model)]
chosen = {m: blocks.choose(model, m) for m in ("auto", "step", "blocks")}
plain = keras.Sequential([layers.Dense(4)])
plain.build((None, 4))
chosen["auto_plain"] = blocks.choose(plain, "auto")
original = Block.call
routed = [layer.name for layer in plan.install(model, training=False).blocks]
installed = all("call" in vars(layer) for layer in blocks.repeated(model))
y = model(keras.ops.ones((2, 4)))   # no distribution: Keras's own call
plan.uninstall(model)
uninstalled = all("call" not in vars(layer) for layer in model.layers)
plan.install(model, training=False)
kdf.deactivate()
print(json.dumps({
    "found": found, "routed": routed, "installed": installed,
    "shape": list(y.shape), "uninstalled": uninstalled,
    "restored": all("call" not in vars(layer) for layer in model.layers),
    "class": Block.call is original, "chosen": chosen,
}))
"""


def test_blocks_are_the_repeated_composite_layers(run_py) -> None:
    """Also which compilation each mode gives: by default (``auto``) a model
    repeating blocks trains block by block (before issue 53's default switch
    it compiled the whole step); ``step`` opts out."""
    out = last_json(run_py(REPEATED.replace("{BLOCK}", BLOCK)))
    chosen = {mode: tuple(why) for mode, why in out["chosen"].items()}
    assert chosen["auto"][0] == "blocks"
    assert "the default for repeated blocks (2 Block)" in chosen["auto"][1]
    assert chosen["step"] == ("step", "KERAS_DTENSOR_FIX_COMPILE=step")
    assert chosen["blocks"] == ("blocks", "KERAS_DTENSOR_FIX_COMPILE=blocks")
    assert chosen["auto_plain"] == ("step", "the default: the model repeats no block")
    assert out["found"] == ["b0", "b1"]
    assert out["routed"] == ["b0", "b1"] and out["installed"]
    assert out["shape"] == [2, 4] and out["uninstalled"]
    assert out["restored"] and out["class"]


TAIL = r"""
import json, os
os.environ["KERAS_BACKEND"] = "torch"
import keras
import numpy as np
from keras import layers
import keras_dtensor_fix as kdf
import torch
from keras_dtensor_fix.compiled import blocks, tail, update_groups

{BLOCK}

def functional(head=True):
    inputs = keras.Input((4,))
    x = layers.Dense(4, name="embed")(inputs)
    x = Block(name="b1")(Block(name="b0")(x))
    if head:
        x = layers.Dense(4, name="norm")(x)
        x = layers.Dense(3, name="head")(x)
    return keras.Model(inputs, x)

class Own(keras.Model):
    def train_step(self, data):
        return super().train_step(data)

model = functional()
routed = blocks.repeated(model)
found = tail.plan(model, routed)

def nested_model():
    inputs = keras.Input((4,))
    x = layers.Dense(4, name="embed")(inputs)
    x = layers.Dense(4, name="final")(Block(name="n1")(Block(name="n0")(x)))
    backbone = keras.Model(inputs, x, name="backbone")
    outer = keras.Input((4,))
    return keras.Model(outer, layers.Dense(3, name="head")(backbone(outer)))

nested = nested_model()
opened = tail.plan(nested, blocks.repeated(nested))
inputs = keras.Input((4,))
own = Own(inputs, layers.Dense(3)(Block()(Block()(inputs))))
plain = keras.Sequential([layers.Dense(4)])
plain.build((None, 4))
last = functional(head=False)
refused = {
    "blocks last": tail.plan(last, blocks.repeated(last)),
    "own train_step": tail.plan(own, blocks.repeated(own)),
    "sequential": tail.plan(plain, []),
}
installed = tail.install(model, routed)
SET = ("_run_through_graph", "_compute_loss")
attributes = sorted(k for k in vars(model) if k in SET)
y = model(keras.ops.ones((2, 4)))   # no train step running: Keras's own call
tail.uninstall(model, installed)
after = sorted(k for k in vars(model) if k in SET)
tail.install(model, routed)
model.compile(optimizer="adam", loss="mse")
own.compile(optimizer="adam", loss="mse")
UPDATE = "_parallel_update_step"
updates = {
    "refused": update_groups.install(own, blocks.repeated(own)),
    "installed": update_groups.install(model, routed),
    "update": UPDATE in vars(model.optimizer),
}
model.fit(np.ones((4, 4)), np.ones((4, 3)), verbose=0)  # no distribution: Keras's
updates["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
update_groups.uninstall(model)
updates["after"] = UPDATE in vars(model.optimizer)
update_groups.install(model, routed)
kdf.deactivate()
updates["restored"] = UPDATE in vars(model.optimizer)
print(json.dumps({
    "nested": {
        "front": [n.operation.name for n in opened.front],
        "tail": [n.operation.name for n in opened.tail],
        "boundary": len(opened.boundary),
    },
    "updates": updates,
    "front": [n.operation.name for n in found.front],
    "tail": [n.operation.name for n in found.tail],
    "boundary": len(found.boundary), "refused": refused,
    "installed": not isinstance(installed, str),
    "attributes": attributes, "shape": list(y.shape), "after": after,
    "restored": sorted(k for k in vars(model) if k in SET),
}))
"""


def test_tail_splits_after_the_last_block(run_py) -> None:
    """The layers after the last block (``compiled/tail.py``): the graph's
    nodes split after the last one holding a block; a model whose blocks end
    it, one with its own ``train_step`` and a Sequential have no tail region.
    Installing sets two attributes on the instance; uninstalling and
    deactivation take them off. The optimizer's update per block
    (``compiled/update_groups.py``): its ``_parallel_update_step`` installed
    on the optimizer, not for a model with its own ``train_step``, Keras's own
    update without a distribution, taken off by uninstalling and
    deactivation."""
    out = last_json(run_py(TAIL.replace("{BLOCK}", BLOCK)))
    # a nested model holding the blocks (a keras-hub backbone) runs whole in
    # the front; the outer head is the region
    assert out["nested"] == {"front": ["backbone"], "tail": ["head"], "boundary": 1}
    assert out["updates"] == {
        "refused": "its class has a train_step() of its own",
        "installed": None,
        "update": True,
        "graphs": 0,
        "after": False,
        "restored": False,
    }
    assert out["front"] == ["embed", "b0", "b1"]
    assert out["tail"] == ["norm", "head"] and out["boundary"] == 1
    assert out["refused"] == {
        "blocks last": "no layer follows its last block",
        "own train_step": "its class has a train_step() of its own",
        "sequential": "it is not a functional model",
    }
    assert out["installed"] is True
    assert out["attributes"] == ["_compute_loss", "_run_through_graph"]
    assert out["shape"] == [2, 3] and out["after"] == [] and out["restored"] == []


SAVED = r"""
import json, os, types
os.environ["KERAS_BACKEND"] = "torch"
import torch
from keras_dtensor_fix.compiled import region

torch.manual_seed(0)
w1 = torch.randn(8, 32, requires_grad=True)
b1 = torch.randn(32, requires_grad=True)
w2 = torch.randn(32, 8, requires_grad=True)

def mlp(x):
    return torch.relu(x @ w1 + b1) @ w2

dist = types.SimpleNamespace(device_mesh=types.SimpleNamespace(shape=(1,)))
x = torch.randn(4, 16, 8)  # 3-D: matmul sees relu through a view
saved = {}
for name, function in (
    ("region", region.compile_static(mlp, dist)),
    ("user", torch.compile(lambda x: mlp(x))),
):
    out = function(x)
    saved[name] = sorted(str(t.dtype) for t in out.grad_fn.saved_tensors)
    out.sum().backward()
    saved[name + "_grad"] = w1.grad.clone().tolist()
    w1.grad = b1.grad = w2.grad = None
print(json.dumps({
    "saved": saved,
    "after": torch._functorch.config.recompute_views,
}))
"""


def test_a_region_saves_no_boolean_mask(run_py) -> None:
    """A region's forward saves relu's output, not its boolean mask: inductor's
    CPU code for boolean masks is slow (the per-block cost of blocks mode on a
    relu decoder, issue 53). With torch's default partitioning, as a user's own
    ``torch.compile`` keeps, the region saved a ``torch.bool`` too. The gradients
    are the same either way, and the setting stays with the regions."""
    out = last_json(run_py(SAVED, env={"TORCHINDUCTOR_CACHE_DIR": None}))
    assert "torch.bool" not in out["saved"]["region"], out["saved"]
    assert out["saved"]["region_grad"] == out["saved"]["user_grad"]
    assert out["after"] is False
