"""``KERAS_DTENSOR_FIX_COMPILE=blocks`` without processes: the mode's
parsing, which layers are blocks, and that deactivation takes the regions
back. The compiled regions themselves run in ``multiprocess/test_blocks.py``."""

from __future__ import annotations

import warnings

import pytest

from keras_dtensor_fix.engine import config
from support import last_json


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
from keras_dtensor_fix.compiled import blocks

class Block(layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.inner = layers.Dense(4)
        self.outer = layers.Dense(4)
    def call(self, x):
        return self.outer(self.inner(x))

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
routed = [layer.name for layer in blocks.install(model, lambda error: False)]
installed = all("call" in vars(layer) for layer in blocks.repeated(model))
y = model(keras.ops.ones((2, 4)))   # no distribution: Keras's own call
blocks.uninstall(model)
uninstalled = all("call" not in vars(layer) for layer in model.layers)
blocks.install(model, lambda error: False)
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
    out = last_json(run_py(REPEATED))
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
