"""``auto_layout_map`` on one process: what it splits, for which models.

One interpreter plans a Sequential MLP, keras.io's transformer classifier, a
subclassed model of custom layers, a conv net, an MLP-Mixer block (the
models of ``multiprocess/cases_planned.py``) and tiny keras-hub BERT, Gemma,
Llama and QwenMoe backbones on (1, 2), (2, 1) and (1, 3) meshes (devices
named, never started). Checked: Megatron's pairs (column then row, heads for
attention, vocabulary for tables), nothing split that does not divide,
keras-hub's own Gemma map reproduced weight for weight and Llama's and
QwenMoe's beaten or matched on the cost model's bytes per rank and
collectives, rules that give each weight its split and print as runnable
Python, and a model built after planning named and initialized as without.
The sharded runs: ``multiprocess/test_planned.py``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support import ROOT, clean_env, last_json

pytest.importorskip("keras_hub")

PROGRAM = """
import json, sys
sys.path.insert(0, sys.argv[1])
import keras, keras_hub, numpy as np
import keras_dtensor_fix as kdf
import cases_planned as c
from keras_dtensor_fix.planning.cost import evaluate

def mesh(shape):
    names = [f"cpu:{i}" for i in range(shape[0] * shape[1])]
    return keras.distribution.DeviceMesh(shape, ["batch", "model"], names)

def axes(layout_map, paths):
    return {p: (list(layout_map[p].axes) if layout_map[p] else None) for p in paths}

def hub(name, **kw):
    base = dict(vocabulary_size=256, num_layers=2, hidden_dim=64)
    return lambda: getattr(keras_hub.models, name + "Backbone")(**base, **kw)

GQA = dict(num_query_heads=4, num_key_value_heads=2, intermediate_dim=128)
HUB = {
    "gemma": hub("Gemma", head_dim=16, **GQA),
    "llama": hub("Llama", **GQA),
    "qwen_moe": hub("QwenMoe", num_query_heads=4, num_key_value_heads=2,
                    intermediate_dim=128, moe_intermediate_dim=32,
                    shared_expert_intermediate_dim=64, num_experts=4, top_k=2),
}
out = {}
for kind, (build, _, sample) in c.MODELS.items():
    for shape in ((1, 2), (2, 1), (1, 3)):
        lm = kdf.auto_layout_map(build, mesh(shape), sample)
        paths = lm.plan.traced.shapes
        out[f"{kind}{shape}"] = {
            "axes": axes(lm, paths),
            "roles": {p: ch.role for p, ch in lm.plan.choices.items()},
            "ratio": lm.plan.cost.bytes_per_rank / lm.plan.cost.bytes_one_process,
            "device": lm.plan.traced.device,
        }
for kind, build in HUB.items():
    m = mesh((1, 2))
    lm = kdf.auto_layout_map(build, m)
    plan = lm.plan
    own = type(build()).get_layout_map(m)
    paths = plan.traced.shapes
    theirs = {p: (tuple(own[p].axes) if own[p] else ()) for p in paths}
    cost = evaluate(plan.traced.flow, plan.traced.nbytes, theirs, plan.mesh)
    out[kind] = {
        "axes": axes(lm, paths),
        "theirs": axes(own, paths),
        "mine": [plan.cost.bytes_per_rank, plan.cost.count, plan.cost.moved],
        "their_cost": [cost.bytes_per_rank, cost.count, cost.moved],
    }
# printed rules rebuild the same map
m = mesh((1, 2))
lm = kdf.auto_layout_map(HUB["llama"], m)
scope = {"keras": keras, "mesh": m}
exec(repr(lm), scope)
again = scope["layout_map"]
paths = lm.plan.traced.shapes
out["repr_equal"] = axes(again, paths) == axes(lm, paths)
out["repr"] = repr(lm)
# a model built after planning: the names and initial weights of one built without
keras.utils.set_random_seed(7)
plain = c.mlp()
names = [w.path for w in plain.weights]
first = [np.asarray(w) for w in plain.weights]
def number(name):
    return int(name.rpartition("_")[2]) if name[-1].isdigit() else 0
before = number(c.mlp().name)  # sequential_N
keras.utils.set_random_seed(7)
kdf.auto_layout_map(c.mlp, m)  # builds sequential_N+1 on meta, then forgets it
after = c.mlp()
out["names_kept"] = number(after.name) == before + 1
out["seed_kept"] = all(
    np.array_equal(a, np.asarray(b)) for a, b in zip(first, after.weights))
errors = {}
for label, call in {
    "no_model_axis": lambda: kdf.auto_layout_map(c.mlp, keras.distribution.DeviceMesh(
        (1, 2), ["batch", "tp"], ["cpu:0", "cpu:1"])),
    "no_inputs": lambda: kdf.auto_layout_map(c.Subclassed, m),
    "not_callable": lambda: kdf.auto_layout_map(c.mlp(), m),
    "not_a_mesh": lambda: kdf.auto_layout_map(c.mlp, (1, 2)),
}.items():
    try:
        call()
        errors[label] = None
    except Exception as exc:
        errors[label] = f"{type(exc).__name__}: {exc}"
out["errors"] = errors
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def planned() -> dict:
    folder = str(ROOT / "tests" / "multiprocess")
    proc = subprocess.run(
        [sys.executable, "-c", PROGRAM, folder],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
        cwd=str(ROOT),
    )
    return last_json(proc)


def test_mlp_pairs_column_then_row(planned) -> None:
    plan = planned["mlp(1, 2)"]["axes"]
    assert plan["sequential/dense_1/kernel"] == ["batch", "model"]
    assert plan["sequential/dense_1/bias"] == ["model"]
    assert plan["sequential/dense_2/kernel"] == ["model", "batch"]
    # a row layer's bias and the small classifier head stay whole
    assert plan["sequential/dense_2/bias"] is None
    assert plan["sequential/dense_3/kernel"] is None
    assert planned["mlp(1, 2)"]["device"] == "meta"


def test_attention_splits_by_heads(planned) -> None:
    plan = planned["transformer(1, 2)"]["axes"]
    for name in ("query", "key", "value"):
        assert plan[f"mha/{name}/kernel"] == ["batch", "model", None]
        assert plan[f"mha/{name}/bias"] == ["model", None]
    assert plan["mha/attention_output/kernel"] == ["model", None, "batch"]
    assert plan["mha/attention_output/bias"] is None
    assert plan["ffn_1/kernel"] == ["batch", "model"]
    assert plan["ffn_2/kernel"] == ["model", "batch"]
    assert plan["ln_1/gamma"] is None and plan["head/kernel"] is None


def test_custom_layers_conv_and_mixer(planned) -> None:
    sub = planned["subclassed(1, 2)"]["axes"]
    assert sub["subclassed/block_0/w_in"] == ["batch", "model"]
    assert sub["subclassed/block_1/w_out"] == ["model", "batch"]
    conv = planned["convnet(1, 2)"]["axes"]
    assert conv["sequential/conv/kernel"] is None  # the plugin gathers it
    assert conv["sequential/fc_1/kernel"] == ["batch", "model"]
    assert conv["sequential/fc_2/kernel"] == ["model", "batch"]
    mixer = planned["mixer(1, 2)"]["axes"]
    assert mixer["token_1/kernel"] == mixer["channel_1/kernel"] == ["batch", "model"]
    assert mixer["token_2/kernel"] == mixer["channel_2/kernel"] == ["model", "batch"]


def test_bert_vocabulary_and_blocks(planned) -> None:
    plan = planned["bert(1, 2)"]["axes"]
    assert plan["token_embedding/embeddings"] == ["model", "batch"]
    assert plan["position_embedding/embeddings"] is None
    assert plan["segment_embedding/embeddings"] is None
    block = "transformer_layer_1/"
    assert plan[block + "self_attention_layer/query/kernel"] == ["batch", "model", None]
    assert plan[block + "feedforward_output_dense/kernel"] == ["model", "batch"]


@pytest.mark.parametrize("kind", ["mlp", "transformer", "bert", "mixer"])
def test_half_the_bytes_on_two_ranks(planned, kind: str) -> None:
    assert planned[f"{kind}(1, 2)"]["ratio"] <= 0.6
    assert planned[f"{kind}(2, 1)"]["ratio"] <= 0.6  # the batch axis splits too


def test_nothing_split_that_does_not_divide(planned) -> None:
    for kind in ("mlp", "transformer", "subclassed"):
        plan = planned[f"{kind}(1, 3)"]
        assert all(axes is None for axes in plan["axes"].values()), kind
        assert plan["ratio"] == 1.0


def test_gemma_equals_keras_hubs_own_map(planned) -> None:
    assert planned["gemma"]["axes"] == planned["gemma"]["theirs"]


def test_experts_split_by_their_ffn_axis(planned) -> None:
    """Stacked experts (experts, hidden, ffn) and (experts, ffn, hidden): the
    FFN axis, not the experts axis the down projection shares; the router and
    norms whole."""
    plan = planned["qwen_moe"]["axes"]
    gates = [p for p in plan if p.endswith("experts/expert_feedforward_gate_dense")]
    downs = [p for p in plan if p.endswith("experts/expert_feedforward_output_dense")]
    assert gates and downs
    assert all(plan[p] == [None, "batch", "model"] for p in gates)
    assert all(plan[p] == [None, "model", "batch"] for p in downs)
    routers = [p for p in plan if "sparse_feedforward_gate_dense" in p]
    assert routers and all(plan[p] is None for p in routers), routers


@pytest.mark.parametrize("kind", ["gemma", "llama", "qwen_moe"])
def test_no_worse_than_keras_hubs_own_map(planned, kind: str) -> None:
    """Bytes per rank, collectives per step and their bytes (``cost.py``)."""
    mine, theirs = planned[kind]["mine"], planned[kind]["their_cost"]
    assert all(m <= t for m, t in zip(mine, theirs, strict=True)), (mine, theirs)


def test_rules_print_as_python(planned) -> None:
    assert planned["repr_equal"]
    text = planned["repr"]
    assert "layout_map = keras.distribution.LayoutMap(mesh)" in text
    assert r'layout_map[r"transformer_layer_\d+/self_attention/' in text


def test_a_later_model_is_built_as_without_planning(planned) -> None:
    assert planned["names_kept"]
    assert planned["seed_kept"]


def test_bad_arguments_say_what_to_pass(planned) -> None:
    errors = planned["errors"]
    assert "'model' is not an axis of the mesh" in errors["no_model_axis"]
    assert "pass sample_input=" in errors["no_inputs"]
    assert errors["not_callable"].startswith("TypeError: build must be a callable")
    assert errors["not_a_mesh"].startswith("TypeError: mesh must be")


MODEL = """
import keras

def build():
    return keras.Sequential([
        keras.Input((16,)),
        keras.layers.Dense(64, activation="relu", name="up"),
        keras.layers.Dense(16, name="down"),
    ])
"""


def test_plan_command_prints_table_totals_and_rules(run_py, tmp_path) -> None:
    (tmp_path / "model.py").write_text(MODEL)
    target = f"{tmp_path / 'model.py'}:build"
    proc = run_py(module="keras_dtensor_fix", argv=["plan", target, "--mesh", "1x2"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["WEIGHT", "SHAPE", "SPLIT", "PER", "RANK"] + [
        "COLLECTIVES",
        "PER",
        "STEP",
    ]
    row = next(line for line in lines if line.startswith("sequential/up/kernel"))
    assert "(16, 64)" in row and "(batch, model) column" in row and "2.0 KiB" in row
    assert "all-reduce of its input's gradient" in row
    assert any("(0.5" in line for line in lines if line.startswith("weights per rank"))
    assert "layout_map[r\"sequential/down/kernel\"] = ('model', 'batch')" in lines
    bad = run_py(module="keras_dtensor_fix", argv=["plan", "no_colon"])
    assert bad.returncode != 0 and "expected MODULE:FUNCTION" in bad.stderr


@pytest.mark.slow
def test_7b_models_planned_without_their_weights(run_py) -> None:
    """Gemma-7B's and Llama-3-8B's shapes plan on meta in under 2 GB (peak
    resident memory; the time is the benchmark's to report)."""
    proc = run_py(args=[str(ROOT / "benchmarks" / "plan_7b.py")])
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = [json.loads(line) for line in proc.stdout.splitlines() if line[:1] == "{"]
    assert [f["model"] for f in found] == ["gemma_7b", "llama_3_8b"]
    for model in found:
        assert model["device"] == "meta" and model["parameters"] > 7e9, model
        assert model["peak_rss_gb"] <= 2.0, model
