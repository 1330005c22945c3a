"""A compiled function that traces a numpy operator reads the compile caches back.

The torch reproducer of Gemma's warm-start miss (``x * (1 / np.sqrt(d))``,
keras-hub's query scaling), compiled by two fresh interpreters on one cache
directory: with the ``compile_cache`` family the second finds AOT autograd's
entry (a hit, no bypass); without it (torch 2.13 as is) AOT autograd bypasses
its cache on every launch ("Unsupported call_function target <Wrapped
operator <original wrapped_truediv>>") and compiles again.
"""

from __future__ import annotations

import json

import pytest

from support import last_json

SCRIPT = """
import json
import numpy as np
import torch
import keras  # the torch backend: the plugin's gate opens
import keras_dtensor_fix

def scaled(x):
    return torch.sin(x) * (1 / np.sqrt(8))

torch.compile(scaled)(torch.ones(4, requires_grad=True)).sum().backward()
counters = torch._dynamo.utils.counters
print(json.dumps({k: dict(v) for k, v in counters.items()
                  if k in ("aot_autograd", "inductor")}))
"""


def launches(run_py, tmp_path, *names: str, **env: str) -> list[dict]:
    # The caches' keys are the point, not inductor's vector code: without
    # it a cold launch skips the ISA probe (about 20 of its 24 s here).
    cache = {
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"),
        "TORCHINDUCTOR_VEC_ISA_OK": "0",
        **env,
    }
    return [last_json(run_py(SCRIPT, env=cache)) for _ in names]


def test_warm_launch_hits_the_aot_autograd_cache(run_py, tmp_path) -> None:
    cold, warm = launches(run_py, tmp_path, "cold", "warm")
    assert cold["aot_autograd"].get("autograd_cache_miss", 0) >= 1, cold
    assert warm["aot_autograd"].get("autograd_cache_hit", 0) >= 1, warm
    assert not warm["aot_autograd"].get("autograd_cache_bypass"), warm


def test_without_the_family_every_launch_bypasses(run_py, tmp_path) -> None:
    """Control: torch alone (the family disabled) bypasses the cache. One
    launch shows it: a bypass saves nothing, so no later launch can hit."""
    (cold,) = launches(
        run_py, tmp_path, "cold", KERAS_DTENSOR_FIX_DISABLE="compile_cache"
    )
    assert cold["aot_autograd"].get("autograd_cache_bypass", 0) >= 1, cold
    assert not cold["aot_autograd"].get("autograd_cache_hit"), cold
    assert not cold["aot_autograd"].get("autograd_cache_saved"), cold


def test_operator_key_only_for_operator_functions() -> None:
    import operator

    torch = pytest.importorskip("torch")
    from torch._dynamo.utils import numpy_operator_wrapper

    from keras_dtensor_fix.patches.compile_cache import operator_key

    assert operator_key(numpy_operator_wrapper(operator.truediv)) == (
        "numpy_operator_wrapper",
        "operator.truediv",
    )
    assert operator_key(numpy_operator_wrapper(lambda a, b: a / b)) is None
    assert operator_key(torch.sin) is None
    assert json.dumps(operator_key(numpy_operator_wrapper(operator.add)))


def test_mesh_key_names_what_a_graph_depends_on(mesh1) -> None:
    """A DeviceMesh input is keyed by its values, not by pickling the object
    (whose memo made QwenMoe's key differ at every launch: see
    test_hub.py::test_moe_compiled_cold_then_warm)."""
    import pickle

    from torch.distributed.device_mesh import init_device_mesh

    from keras_dtensor_fix.patches.compile_cache import mesh_key

    key = mesh_key(mesh1)
    assert key == ("cpu", (1,), [0], None, ())
    other = init_device_mesh("cpu", (1,), mesh_dim_names=("model",))
    assert mesh_key(other) == ("cpu", (1,), [0], ("model",), ())
    assert pickle.dumps(mesh_key(mesh1)) == pickle.dumps(key)
    assert mesh_key(object()) is None and mesh_key(None) is None
