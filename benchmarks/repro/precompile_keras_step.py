"""Which guards keep a Keras ``jit_compile=True`` train step out of torch's
caching precompile.

Trains a 2-layer Dense model one epoch with ``jit_compile=True`` and
``torch._dynamo.config.caching_precompile`` on (strict), without a
distribution (``plain``) or under a ModelParallel of a one-rank mesh with the
plugin (``model-parallel``), and prints the outcome and every guard of the
step that torch cannot serialize (``precompile_type_guard.py`` has the pure
torch case). One process:

    KERAS_BACKEND=torch python benchmarks/repro/precompile_keras_step.py plain
    KERAS_BACKEND=torch python benchmarks/repro/precompile_keras_step.py model-parallel
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("KERAS_BACKEND", "torch")

import torch  # noqa: E402
from torch._dynamo.guards import CheckFunctionManager  # noqa: E402

torch._dynamo.config.caching_precompile = True
torch._dynamo.config.strict_precompile = True
UNSERIALIZABLE: list[str] = []
_serialize = CheckFunctionManager.serialize_guards


def serialize_guards(self, builder, sorted_guards, output_graph):
    """torch's check, each guard it cannot serialize noted first."""
    refused = CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    for guard in sorted_guards:
        kinds = (guard.create_fn_name(), *(guard.guard_types or ()))
        bad = [kind for kind in kinds if kind in refused]
        if bad:
            UNSERIALIZABLE.append(f"{bad[0]} on {guard.name}")
    return _serialize(self, builder, sorted_guards, output_graph)


CheckFunctionManager.serialize_guards = serialize_guards

import keras  # noqa: E402
import numpy as np  # noqa: E402


def main(mode: str) -> None:
    if mode == "model-parallel":
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT="29593", RANK="0", WORLD_SIZE="1"
        )
        keras.distribution.initialize()
        devices = keras.distribution.list_devices()[:1]
        mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices)
        layouts = keras.distribution.LayoutMap(mesh)
        layouts["d1/kernel"] = (None, "model")
        keras.distribution.set_distribution(
            keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
        )
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.layers.Input((8,)),
            keras.layers.Dense(16, name="d1"),
            keras.layers.Dense(1, name="d2"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse", jit_compile=True)
    x, y = np.ones((16, 8), "float32"), np.ones((16, 1), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model.fit(x, y, batch_size=8, epochs=1, verbose=0)
            print(f"{mode}: fit() ran")
        except Exception as err:  # noqa: BLE001 - what torch raises is the point
            print(f"{mode}: {type(err).__name__}: {str(err).strip()}")
    for warning in caught:
        if "keras-dtensor-fix" in str(warning.message):
            print(f"  warned: {warning.message}")
    for guard in dict.fromkeys(UNSERIALIZABLE):
        print(f"  cannot serialize: {guard} (x{UNSERIALIZABLE.count(guard)})")
    sys.stdout.flush()
    os._exit(0)  # skips a gloo teardown that can abort (tests/support.leave)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain")
