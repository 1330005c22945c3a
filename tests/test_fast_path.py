"""The wrappers' fast path: a non-distributed Keras step barely notices the plugin.

Counted, not timed: in one fresh interpreter a Keras model (Dense, EinsumDense,
LayerNormalization, Dropout, Adam, a loss and a metric) takes train steps with
the plugin active and deactivated in turn. The step must dispatch exactly the
same torch ops either way, and run only a few more Python calls: the gates of
the traced methods and of the compiled-step wrapper while no sharded
distribution was ever set (the gated wrappers are closed), and also each
wrapper's fast path once one was (a process that used ModelParallel before).
"""

from __future__ import annotations

import pytest

from support import last_json

CODE = """
import collections, json, sys
import numpy as np
import keras
from torch.utils._python_dispatch import TorchDispatchMode
import keras_dtensor_fix
from keras_dtensor_fix.engine import state
if OPEN:
    state.note_sharding()  # as after a ModelParallel run in this process

keras.utils.set_random_seed(0)
inputs = keras.Input((6, 16))
h = keras.layers.EinsumDense("btd,df->btf", (6, 32), bias_axes="f")(inputs)
h = keras.layers.LayerNormalization()(h)
h = keras.layers.Dropout(0.1)(h)
h = keras.layers.Dense(32, activation="relu")(h)
outputs = keras.layers.Dense(4)(h)
model = keras.Model(inputs, outputs)
model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", metrics=["mae"])
x = np.random.default_rng(0).normal(size=(8, 6, 16)).astype("float32")
y = np.zeros((8, 6, 4), "float32")

class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))

def measure(active):
    (keras_dtensor_fix.activate if active else keras_dtensor_fix.deactivate)()
    for _ in range(3):
        model.train_on_batch(x, y)
    calls = collections.Counter()
    def profile(frame, event, arg):
        if event == "call":
            code = frame.f_code
            calls[f"{code.co_filename}:{code.co_name}"] += 1
        elif event == "c_call":
            calls["C"] += 1
    mode = Ops()
    with mode:
        sys.setprofile(profile)
        model.train_on_batch(x, y)
        sys.setprofile(None)
    return calls, mode.ops

measure(True)  # the first step under a dispatch mode registers things once
on_calls, on_ops = measure(True)
off_calls, off_ops = measure(False)
keras_dtensor_fix.activate()
extra = on_calls.copy()
extra.subtract(off_calls)
print(json.dumps({
    "calls_on": sum(on_calls.values()),
    "calls_off": sum(off_calls.values()),
    "extra": {k: v for k, v in extra.items() if v},
    "ops_on": dict(on_ops),
    "ops_off": dict(off_ops),
}))
"""

# Python calls the plugin may add to one non-distributed train step (of about
# 11,000). Gates closed, about 42 today: the traced Dense/EinsumDense gates, the
# leaves family's Layer.__call__ gates, the compile family's wrapper of
# make_train_function and the optimizers family's of _backend_apply_gradients
# (its branch selection when compiled). Gates open, about 620:
# every wrapped op's test for a DTensor among its arguments, and every layer
# call's test of its first argument (the leaves family). Taking the slow path
# (promote_call) in every wrapped op costs over 1,000 more.
EXTRA_CALLS = {False: 50, True: 700}


@pytest.mark.parametrize("gates_open", [False, True], ids=["closed", "open"])
def test_non_distributed_step_is_untouched(run_py, gates_open: bool) -> None:
    proc = run_py(f"OPEN = {gates_open}\n" + CODE, env={"KERAS_BACKEND": "torch"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = last_json(proc)
    assert result["ops_on"] == result["ops_off"], result
    assert sum(result["ops_off"].values()) > 50, result  # the step did run ops
    added = result["calls_on"] - result["calls_off"]
    assert added <= EXTRA_CALLS[gates_open], (added, result["extra"])
