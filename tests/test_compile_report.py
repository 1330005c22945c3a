"""A compiled ModelParallel step says once when it breaks or compiles again.

``fallback.break_report`` turns dynamo's counters before and after one call of
the step into the warning; the end-to-end case fits a one-process
ModelParallel model (a 1 x 1 mesh on a gloo group of one) whose custom layer
makes a graph break. Upstream (plugin off) runs the step eagerly, so it has
nothing to report.
"""

from __future__ import annotations

from keras_dtensor_fix.compiled.fallback import break_report
from support import last_json


def test_report_names_new_breaks_and_recompiles() -> None:
    quiet = ({"reason a": 1}, 3)
    assert break_report(quiet, quiet, 0) is None
    assert break_report(({}, 0), ({}, 2), 0) is None  # the first call compiles
    message = break_report(
        quiet, ({"reason a": 1, "Unsupported: print\nmore": 2}, 5), 0
    )
    assert "has 2 graph break(s) (Unsupported: print)" in message
    assert "TORCH_LOGS=graph_breaks,recompiles" in message
    message = break_report(quiet, ({"reason a": 1}, 4), 1)
    assert "compiled again on call 2" in message
    assert "graph break(s)" not in message


SCRIPT = """
import json, os, warnings
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"],
                  RANK="0", WORLD_SIZE="1")
import keras, numpy as np, torch
# What dynamo reports is the point: its own graphs, run as they are. The break
# leaves the rest of the step to dynamo a frame at a time (well over 100), and
# AOT autograd would trace each again.
_compile = torch.compile
torch.compile = lambda *a, **k: _compile(*a, **{"backend": "eager", **k})
keras.distribution.initialize()
mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"],
                                     keras.distribution.list_devices()[:1])
layouts = keras.distribution.LayoutMap(mesh)
layouts["first/kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch"))

class Breaks(keras.layers.Layer):
    def call(self, x):
        torch._dynamo.graph_break()
        return x

model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(4, name="first"),
                          Breaks(), keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse", jit_compile=True)
x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    model.fit(x, y, batch_size=4, epochs=2, verbose=0)
said = [str(w.message) for w in caught]
said = [m for m in said if m.startswith("keras-dtensor-fix: this compiled")]
print(json.dumps(said))
os._exit(0)
"""


def free_port() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def test_a_graph_break_is_reported_once(run_py) -> None:
    said = last_json(run_py(SCRIPT, env={"PORT": free_port()}))
    assert len(said) == 1, said
    assert "graph break" in said[0]


def test_upstream_reports_nothing(run_py) -> None:
    said = last_json(
        run_py(SCRIPT, env={"PORT": free_port(), "KERAS_DTENSOR_FIX": "0"})
    )
    assert said == []
