"""The ``generate`` family on one process: what it leaves behind and its fallback.

Compiled generation itself (tokens equal one eager process, a graph for the
token step) runs sharded in ``tests/multiprocess/test_hub.py``
(``llama_1x2_compiled``, ``test_generate_compiled``); its speed in
``benchmarks/generate_ops.py``. Here too: the ``ops`` family's traced
``slice`` at a tensor start (GPT-2's position embedding) on a one-rank mesh.
"""

from __future__ import annotations

import pytest

from support import last_json

pytest.importorskip("keras_hub")

#: Each child sets a one-rank ModelParallel: the family compiles tokens only
#: under ModelParallel (unsharded, keras-hub's eager generation stands). It
#: builds its models with ``tiny_gemma`` (a subclass where given).
ONE_RANK = r"""
def one_rank_model_parallel():
    import keras
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    mesh = keras.distribution.DeviceMesh(
        (1, 1), ["batch", "model"], keras.distribution.list_devices()
    )
    keras.distribution.set_distribution(keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"
    ))


def tiny_gemma(jit_compile, cls=None):
    import keras, keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8,
    )
    lm = (cls or keras_hub.models.GemmaCausalLM)(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy", jit_compile=jit_compile)
    return lm
"""

CODE = r"""
import json, warnings
import numpy as np
import torch
import keras, keras_hub
import keras_dtensor_fix
from keras_hub.src.models import causal_lm
from keras_dtensor_fix.generation import tokens as family

original = causal_lm.CausalLM.__dict__["make_generate_function"].__wrapped__
one_rank_model_parallel()


def failing(*args, **kwargs):
    def call(*a, **k):
        raise RuntimeError("no compiler here")
    return call


torch.compile = failing  # the family's compiled token step raises
ids = np.zeros((2, 10), "int32")
ids[:, :4] = 5
prompt = {"token_ids": ids, "padding_mask": ids > 0}
eager = tiny_gemma(False).generate(prompt, stop_token_ids=None)["token_ids"]
lm = tiny_gemma(True)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = lm.generate(prompt, stop_token_ids=None)["token_ids"]
    second = lm.generate(prompt, stop_token_ids=None)["token_ids"]
keras_dtensor_fix.deactivate()
print(json.dumps({
    "warnings": [str(w.message) for w in caught if "dtensor-fix" in str(w.message)],
    "equal": [np.asarray(first).tolist() == np.asarray(eager).tolist(),
              np.asarray(second).tolist() == np.asarray(eager).tolist()],
    "left_on_model": "call_with_cache" in vars(lm),
    "restored": causal_lm.CausalLM.__dict__["make_generate_function"] is original,
}))
"""


def test_a_failed_compile_generates_eagerly_and_leaves_nothing(run_py) -> None:
    """The compiled token step raises: one warning, the same tokens as an
    eager model (both calls), nothing left on the model, and deactivation
    puts keras-hub's own ``make_generate_function`` back."""
    out = last_json(run_py(ONE_RANK + CODE, timeout=300))
    assert len(out["warnings"]) == 1, out["warnings"]
    assert "runs eagerly" in out["warnings"][0]
    assert "no compiler here" in out["warnings"][0]
    assert out["equal"] == [True, True]
    assert out["left_on_model"] is False
    assert out["restored"] is True


DEFEATED = r"""
import json, warnings
import numpy as np
import keras, keras_hub
import keras_dtensor_fix
from keras_dtensor_fix.generation import tokens as family

one_rank_model_parallel()


class Opaque(keras_hub.models.GemmaCausalLM):
    def call_with_cache(self, *args, **kwargs):  # no token, cache, index to read
        return super().call_with_cache(*args, **kwargs)


def broken(*args, **kwargs):
    raise RuntimeError("defeated on purpose")


ids = np.zeros((2, 10), "int32")
ids[:, :4] = 5
prompt = {"token_ids": ids, "padding_mask": ids > 0}
eager = tiny_gemma(False).generate(prompt, stop_token_ids=None)["token_ids"]
out = {}
for name in ("signature", "first_token"):
    lm = tiny_gemma(True, Opaque if name == "signature" else None)
    if name == "first_token":  # the step raises before its compiled call
        family.on_mesh = broken
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = [lm.generate(prompt, stop_token_ids=None)["token_ids"] for _ in "ab"]
    out[name] = {
        "warnings": [str(w.message) for w in caught if "dtensor-fix" in str(w.message)],
        "equal": [np.asarray(t).tolist() == np.asarray(eager).tolist() for t in tokens],
    }
print(json.dumps(out))
"""


def test_a_defeated_token_step_generates_eagerly(run_py) -> None:
    """The compiled token step met where it cannot go: a ``call_with_cache``
    whose token, cache and index it cannot tell (``*args``: refused before it
    runs), or a first token whose step raises outside the compiled call.
    Either warns once, naming the cause, and generates as upstream does
    (eagerly), the same tokens as an eager model on both calls. Before the
    token step read the model's signature, the first raised a TypeError from
    the step; before it caught its first token's failure, the second raised
    its error."""
    out = last_json(run_py(ONE_RANK + DEFEATED, timeout=300))
    causes = {"signature": "does not take", "first_token": "defeated on purpose"}
    for name, cause in causes.items():
        warned = out[name]["warnings"]
        assert len(warned) == 1, (name, warned)
        assert "runs eagerly" in warned[0] and cause in warned[0], warned
        assert out[name]["equal"] == [True, True], name


BROKEN = r"""
import json, warnings
import numpy as np
import keras_hub

one_rank_model_parallel()


class Broken(keras_hub.models.GemmaCausalLM):
    def call_with_cache(self, token_ids, cache, cache_update_index):
        if token_ids.shape[1] == 1:  # every generated token, not the prompt
            raise RuntimeError("broken on purpose")
        return super().call_with_cache(token_ids, cache, cache_update_index)


lm = tiny_gemma(True, Broken)
ids = np.zeros((2, 10), "int32")
ids[:, :4] = 5
error = None
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        lm.generate({"token_ids": ids, "padding_mask": ids > 0}, stop_token_ids=None)
    except Exception as err:
        error = f"{type(err).__name__}: {err}"
print(json.dumps({
    "error": error,
    "warnings": [str(w.message) for w in caught if "dtensor-fix" in str(w.message)],
}))
"""


@pytest.mark.parametrize("fix", ["1", "0"], ids=["plugin", "upstream"])
def test_a_model_that_fails_eagerly_too_raises_its_error(run_py, fix: str) -> None:
    """A ``call_with_cache`` that raises on every generated token fails the compiled
    step and its eager retry alike: the model's own error reaches the caller, as
    upstream raises it, after one warning. Before a region failed once, the retry's
    error failed it again: two warnings, the second blaming torch.compile."""
    out = last_json(run_py(ONE_RANK + BROKEN, env={"KERAS_DTENSOR_FIX": fix}))
    assert out["error"] == "RuntimeError: broken on purpose", out
    assert len(out["warnings"]) == (1 if fix == "1" else 0), out["warnings"]


SLICE = r"""
import json
import torch, keras
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Replicate, distribute_tensor
import keras_dtensor_fix
from keras_dtensor_fix.engine import state

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
state.note_sharding()  # the gates open, as after a sharded run


def f(x, start):  # keras-hub's PositionEmbedding at a cache index
    return keras.ops.slice(x, (start, 0), (3, 4))


x = torch.arange(40.0).reshape(10, 4)
dx = distribute_tensor(x, DeviceMesh("cpu", [0]), [Replicate()])
compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
equal, error = {}, None
try:
    for s in (0, 4, 7, -5):
        t = torch.tensor(s, dtype=torch.int32)
        equal[s] = bool(torch.equal(compiled(dx, t).full_tensor(), f(x, t)))
except Exception as err:
    error = f"{type(err).__name__}: {str(err)[:3000]}"
print(json.dumps({"equal": equal, "error": error}))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("disable", ["", "ops"], ids=["on", "ops-off"])
def test_a_tensor_start_slices_in_one_graph(run_py, disable: str) -> None:
    """``ops.slice`` of a DTensor at a tensor start compiles into one graph
    (fullgraph) with the eager call's values, a negative start counted from
    the end as ``torch.narrow`` counts it. Keras narrows at the start's
    value: on a DTensor dynamo cannot trace that (the ``ops`` family off)."""
    env = {"KERAS_DTENSOR_FIX_DISABLE": disable}
    out = last_json(run_py(SLICE, env=env, timeout=300))
    if disable:  # Keras's narrow at the start's value, on a DTensor
        assert out["error"] is not None and "narrow" in out["error"], out
        return
    assert out["error"] is None, out
    assert out["equal"] == {"0": True, "4": True, "7": True, "-5": True}
