"""Scenario cases: keras-hub causal LMs compiled with ``jit_compile=True``
that generate without training first (the ``generate`` family compiles each
new token's cached call): greedy tokens against one process's eager ones.

Llama's (and, in the slow tier, Qwen's) compiled generation runs after its
compiled training in ``cases_hub.py``; these cases cover the other decoders:
GPT-2 (a learned position embedding sliced at the cache index, a tensor),
and in the slow tier Gemma and QwenMoe (about 40 s of tracing each on 2
cores) and all three on a (2, 1) mesh; all three on (2, 2) in
``nox -s tests4`` (group ``generate4_compiled``). Gemma3, Gemma4 and
Qwen3.5 (no get_layout_map: Megatron's layout by hand) call
``call_with_cache`` with more arguments than the others, by keyword (image
embeddings, masks): on (1, 2), and on (2, 1) in the slow tier.
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from cases_hub import (
    COMPILED_LAYERS,
    GPT_LAYOUT,
    hub_layout,
    short_prompts,
    tiny_causal_lm,
)
from scenario_kit import case, plugin_warnings


def generate_compiled(kind: str) -> dict:
    """Two greedy ``generate()`` calls of a random ``kind`` model compiled
    with ``jit_compile=True``: tokens, graph breaks, the dynamo graphs the
    second call compiled (0: one graph serves every position and call), and
    the plugin's warnings (one would say it fell back to eager)."""
    import keras

    keras.utils.set_random_seed(1)
    build = tiny_causal_lm if kind in HUB_KINDS else tiny_other_lm
    model = build(kind, COMPILED_LAYERS)
    model.compile(sampler="greedy", jit_compile=True)
    prompt = short_prompts()
    if kind == "gemma3":
        # generate() returns inputs["images"] and cannot concatenate a None
        # (keras-hub, without a preprocessor, on one process too): no image
        prompt["images"] = np.zeros((2, 0, 16, 16, 3), "float32")
    stats = torch._dynamo.utils.counters["stats"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = model.generate(prompt, max_length=12, stop_token_ids=None)
        graphs = stats["unique_graphs"]
        again = model.generate(prompt, max_length=12, stop_token_ids=None)
    return {
        "tokens": np.asarray(tokens["token_ids"]).tolist(),
        "tokens_again": np.asarray(again["token_ids"]).tolist(),
        "graphs_again": stats["unique_graphs"] - graphs,
        # the token graph is the whole call on local tensors (no DTensor)
        "whole_local": _whole_checked(model),
        "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values()),
        "plugin_warnings": plugin_warnings(caught),
    }


#: Kinds ``cases_hub.tiny_causal_lm`` builds; the others :func:`tiny_other_lm`.
HUB_KINDS = ("gemma", "llama", "qwen", "qwen_moe", "qwen3_moe", "gpt2")


def tiny_other_lm(kind: str, layers: int = 1):
    """A tiny random Gemma3, Gemma4 or Qwen3.5 causal LM (text only): their
    ``call_with_cache`` takes more than (token_ids, cache, index), keyword
    arguments among them (image embeddings, masks), and Qwen3.5's cache is a
    tuple of three tensors."""
    import keras_hub

    models = keras_hub.models
    size = {"vocabulary_size": 64, "num_layers": layers, "hidden_dim": 32}
    size |= {"num_query_heads": 4, "num_key_value_heads": 2, "head_dim": 8}
    size |= {"intermediate_dim": 64}
    if kind == "qwen3_5":
        backbone = models.Qwen3_5Backbone(
            layer_types=["full_attention"] * layers,  # the KV cache's blocks
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
            **size,
        )
        return models.Qwen3_5CausalLM(backbone=backbone, preprocessor=None)
    backbone, causal_lm = {
        "gemma3": (models.Gemma3Backbone, models.Gemma3CausalLM),
        "gemma4": (models.Gemma4Backbone, models.Gemma4CausalLM),
    }[kind]
    return causal_lm(backbone=backbone(image_size=16, **size), preprocessor=None)


#: Megatron's layout by hand (these backbones have no get_layout_map):
#: column-parallel Q/K/V and MLP gate/up on their output (head) axis,
#: row-parallel attention output and MLP down on their input axis.
GEMMA3_LAYOUT = {
    r".*attention/(query|key|value)/kernel": ("model", None, None),
    r".*attention/attention_output/kernel": ("model", None, None),
    r".*ffw_gating(_2)?/kernel": (None, "model"),
    r".*ffw_linear/kernel": ("model", None),
}
QWEN3_5_LAYOUT = {
    r".*self_attention/(query|key|value)/kernel": (None, "model", None),
    r".*self_attention/attention_output/kernel": ("model", None, None),
    r".*feedforward_(gate|intermediate)_dense/kernel": (None, "model"),
    r".*feedforward_output_dense/kernel": ("model", None),
}


def _whole_checked(model) -> bool:
    from keras_dtensor_fix.generation.local import WHOLE
    from keras_dtensor_fix.ops.first_call import PROVEN

    return WHOLE.known(model) is PROVEN


def _case(
    kind: str, layout, mesh=(1, 2), slow: bool = False, group="generate_compiled"
) -> None:
    def run():
        return generate_compiled(kind)

    run.__name__ = f"{kind}_{mesh[0]}x{mesh[1]}_generate_compiled"
    case(group, mesh=mesh, layout=layout, slow=slow)(run)


# GPT-2 has no get_layout_map: Megatron's by hand, its LM head tied to the
# token embedding (which the LayoutMap leaves replicated).
GPT2_LAYOUT = {k: v for k, v in GPT_LAYOUT.items() if "lm_head" not in k}
_case("gpt2", GPT2_LAYOUT)
_case("gemma", hub_layout("gemma"), slow=True)
_case("qwen_moe", hub_layout("qwen_moe"), slow=True)
# Gemma3 stands for the models whose token step takes more arguments and
# other caches; Gemma4 (a batched einsum of head-split logits) and Qwen3.5 (a
# cache of three tensors) are the slow tier's.
for _kind in ("gemma3", "gemma4", "qwen3_5"):
    _layout = QWEN3_5_LAYOUT if _kind == "qwen3_5" else GEMMA3_LAYOUT
    _case(_kind, _layout, slow=_kind != "gemma3")
    _case(_kind, _layout, mesh=(2, 1), slow=True)
# (2, 1): every process generates the same prompts, its weights sharded on
# the batch axis where keras-hub's 2-D layouts put them
for _kind in ("gpt2", "gemma", "qwen_moe"):
    _layout = GPT2_LAYOUT if _kind == "gpt2" else hub_layout(_kind)
    _case(_kind, _layout, mesh=(2, 1), slow=True)
    # (2, 2): 4 processes (nox -s tests4)
    _case(_kind, _layout, mesh=(2, 2), group="generate4_compiled")
