"""Tensor-parallel layouts for keras-hub causal LM backbones without their own.

:data:`ROWS` gives each such backbone Megatron's split on the model axis
(column-parallel Q/K/V, MLP and expert in-projections with their biases;
row-parallel attention and MLP out), the batch axis on the other weight axis
where keras-hub's own maps put it (so a ``(N, 1)`` mesh shards weights too),
and embeddings split by vocabulary. Weights no rule names are replicated. A
rule is ``(regex, axes)``: a ``re.fullmatch`` key as LayoutMap's, ``axes``
:data:`MODEL`, :data:`DATA` or ``None`` per weight axis; no two rules of a
row match one path.
"""

from __future__ import annotations

from typing import Any

MODEL, DATA = "model", "data"
Rule = tuple[str, tuple[str | None, ...]]

_EMBEDDING: tuple[Rule, ...] = (
    (r"(.*/)?token_embedding/embeddings", (MODEL, DATA)),
    (r"(.*/)?token_embedding/reverse_embeddings", (DATA, MODEL)),
)
_BLOCK = r"transformer_layer_\d+/"
# Q/K/V kernels (hidden, heads, head_dim) and attention out (heads, head_dim,
# hidden): keras-hub's Llama-style attention, GPT-2's and OPT's too.
_ATTENTION: tuple[Rule, ...] = (
    (_BLOCK + r"(self_)?attention/(query|key|value)/kernel", (DATA, MODEL, None)),
    (_BLOCK + r"(self_)?attention/(query|key|value)/bias", (MODEL, None)),
    (_BLOCK + r"(self_)?attention/attention_output/kernel", (MODEL, None, DATA)),
)
_MLP: tuple[Rule, ...] = (
    (_BLOCK + r"(.*/)?feedforward_(intermediate|gate)_dense/kernel", (DATA, MODEL)),
    (_BLOCK + r"(.*/)?feedforward_intermediate_dense/bias", (MODEL,)),
    (_BLOCK + r"(.*/)?feedforward_output_dense/kernel", (MODEL, DATA)),
)
# Stacked expert kernels (experts, hidden, ffn) and (experts, ffn, hidden).
_EXPERT = _BLOCK + r".*experts/expert_feedforward_"
_EXPERTS: tuple[Rule, ...] = (
    (_EXPERT + r"(gate|intermediate)_dense", (None, DATA, MODEL)),
    (_EXPERT + r"output_dense", (None, MODEL, DATA)),
)
LLAMA_STYLE = _EMBEDDING + _ATTENTION + _MLP
GEMMA_STYLE: tuple[Rule, ...] = (
    *_EMBEDDING,
    # Q/K/V (heads, hidden, head_dim), as keras-hub's Gemma map splits them.
    (r"decoder_block_\d+/attention/(query|key|value)/kernel", (MODEL, DATA, None)),
    (r"decoder_block_\d+/attention/attention_output/kernel", (MODEL, None, DATA)),
    (r"decoder_block_\d+/ffw_gating(_2)?/kernel", (DATA, MODEL)),
    (r"decoder_block_\d+/ffw_linear/kernel", (MODEL, DATA)),
)
GPT_OSS: tuple[Rule, ...] = (
    *_EMBEDDING,
    *_ATTENTION,
    (_BLOCK + r"self_attention/sinks", (MODEL,)),  # one per query head
    (_BLOCK + r"sparse_moe_block/experts/gate_up_proj", (None, DATA, MODEL)),
    (_BLOCK + r"sparse_moe_block/experts/gate_up_proj_bias", (None, MODEL)),
    (_BLOCK + r"sparse_moe_block/experts/down_proj", (None, MODEL, DATA)),
)


def _separate_qkv(attention: str, up: str, down: str) -> tuple[Rule, ...]:
    """Separate Q/K/V Dense-like layers with a 2-D output projection."""
    return (
        *_EMBEDDING,
        (_BLOCK + attention + r"(query|key|value)_dense/kernel", (DATA, MODEL, None)),
        (_BLOCK + attention + r"(query|key|value)_dense/bias", (MODEL, None)),
        (_BLOCK + attention + r"output_dense/kernel", (MODEL, DATA)),
        (_BLOCK + up + r"/kernel", (DATA, MODEL)),
        (_BLOCK + up + r"/bias", (MODEL,)),
        (_BLOCK + down + r"/kernel", (MODEL, DATA)),
    )


FALCON = _separate_qkv("attention/", "dense_h_to_4h", "dense_4h_to_h")
BLOOM = _separate_qkv("self_attention/", "mlp_intermediate_dense", "mlp_output_dense")
# One fused Q/K/V kernel (hidden, heads, 3 * head_dim), split by heads.
GPT_NEOX: tuple[Rule, ...] = (
    *_EMBEDDING,
    (_BLOCK + r"self_attention/query_key_value/kernel", (DATA, MODEL, None)),
    (_BLOCK + r"self_attention/query_key_value/bias", (MODEL, None)),
    (_BLOCK + r"self_attention/attention_output/kernel", (MODEL, DATA)),
    *_MLP,
)
# Q/K/V Dense kernels (hidden, heads * head_dim); o_proj's path has no block.
SMOLLM3: tuple[Rule, ...] = (
    *_EMBEDDING,
    (_BLOCK + r"self_attn/(q|k|v)_proj/kernel", (DATA, MODEL)),
    (r"(.*/)?o_proj/kernel", (MODEL, None, DATA)),
    (_BLOCK + r"mlp/(gate|up)_proj/kernel", (DATA, MODEL)),
    (_BLOCK + r"mlp/down_proj/kernel", (MODEL, DATA)),
)
# Gemma3n's text decoder (Dense Q/K/V kernels); AltUp, LAuReL and the
# per-layer inputs are small and replicated.
_GEMMA3N = r"text_model/decoder_block_\d+/"
GEMMA3N: tuple[Rule, ...] = (
    (r"text_model/embed_tokens/embedding/embeddings", (MODEL, DATA)),
    (_GEMMA3N + r"attention/(q|k|v)_proj/kernel", (DATA, MODEL)),
    (_GEMMA3N + r"attention/o_proj/kernel", (MODEL, DATA)),
    (_GEMMA3N + r"mlp/(gate|up)_proj/kernel", (DATA, MODEL)),
    (_GEMMA3N + r"mlp/down_proj/kernel", (MODEL, DATA)),
)
# RWKV-7: receptance, key, value and the LoRA out-projections column-parallel
# (the time mix's recurrence runs on each rank's heads); outputs row-parallel.
_RWKV7 = r"rwkv_layer_\d+/"
RWKV7: tuple[Rule, ...] = (
    (r"token_embedding/embeddings", (MODEL, DATA)),
    (r"head/kernel", (DATA, MODEL)),
    (_RWKV7 + r"RWKV_TIME_MIX/(receptance|key|value)/kernel", (DATA, MODEL)),
    (_RWKV7 + r"RWKV_TIME_MIX/(w2|a2|v2|g2)", (None, MODEL)),
    (_RWKV7 + r"RWKV_TIME_MIX/output_layer/kernel", (MODEL, DATA)),
    (_RWKV7 + r"RWKV_CMIX/dense_k/kernel", (DATA, MODEL)),
    (_RWKV7 + r"RWKV_CMIX/dense_v/kernel", (MODEL, DATA)),
)
# PARSeq's decoder (its image encoder replicated) and its head, "dense".
_PARSEQ = r"decoder/decoder_layer_\d+/"
PARSEQ: tuple[Rule, ...] = (
    (r"decoder/token_embedding/embeddings", (MODEL, DATA)),
    (_PARSEQ + r"(self|cross)_attention/(query|key|value)/kernel", (DATA, MODEL, None)),
    (_PARSEQ + r"(self|cross)_attention/(query|key|value)/bias", (MODEL, None)),
    (_PARSEQ + r"(self|cross)_attention/attention_output/kernel", (MODEL, None, DATA)),
    (_PARSEQ + r"mlp/dense_1/kernel", (DATA, MODEL)),
    (_PARSEQ + r"mlp/dense_1/bias", (MODEL,)),
    (_PARSEQ + r"mlp/dense_2/kernel", (MODEL, DATA)),
    (r"dense/kernel", (DATA, MODEL)),
    (r"dense/bias", (MODEL,)),
)

_MODELS = "keras_hub.src.models"
#: ``(backbone module, class name)`` -> its rules: the keras-hub text causal
#: LM backbones without a ``get_layout_map`` of their own.
ROWS: dict[tuple[str, str], tuple[Rule, ...]] = {
    (f"{_MODELS}.gemma3.gemma3_backbone", "Gemma3Backbone"): GEMMA_STYLE,
    (f"{_MODELS}.gemma4.gemma4_backbone", "Gemma4Backbone"): GEMMA_STYLE,
    (f"{_MODELS}.pali_gemma.pali_gemma_backbone", "PaliGemmaBackbone"): GEMMA_STYLE,
    (f"{_MODELS}.mistral.mistral_backbone", "MistralBackbone"): LLAMA_STYLE,
    (f"{_MODELS}.mixtral.mixtral_backbone", "MixtralBackbone"): LLAMA_STYLE + _EXPERTS,
    (f"{_MODELS}.phi3.phi3_backbone", "Phi3Backbone"): LLAMA_STYLE,
    (f"{_MODELS}.qwen3.qwen3_backbone", "Qwen3Backbone"): LLAMA_STYLE,
    (f"{_MODELS}.qwen3_5.qwen3_5_backbone", "Qwen3_5Backbone"): LLAMA_STYLE,
    (f"{_MODELS}.qwen3_5_moe.qwen3_5_moe_backbone", "Qwen3_5MoeBackbone"): (
        LLAMA_STYLE + _EXPERTS
    ),
    (f"{_MODELS}.smollm3.smollm3_backbone", "SmolLM3Backbone"): SMOLLM3,
    (f"{_MODELS}.gpt_oss.gpt_oss_backbone", "GptOssBackbone"): GPT_OSS,
    (f"{_MODELS}.falcon.falcon_backbone", "FalconBackbone"): FALCON,
    (f"{_MODELS}.opt.opt_backbone", "OPTBackbone"): LLAMA_STYLE,
    (f"{_MODELS}.bloom.bloom_backbone", "BloomBackbone"): BLOOM,
    (f"{_MODELS}.gpt_neo_x.gpt_neo_x_backbone", "GPTNeoXBackbone"): GPT_NEOX,
    (f"{_MODELS}.gpt2.gpt2_backbone", "GPT2Backbone"): LLAMA_STYLE,
    (f"{_MODELS}.gemma3n.gemma3n_backbone", "Gemma3nBackbone"): GEMMA3N,
    (f"{_MODELS}.rwkv7.rwkv7_backbone", "RWKV7Backbone"): RWKV7,
    (f"{_MODELS}.blip2.blip2_backbone", "BLIP2Backbone"): LLAMA_STYLE,
    (f"{_MODELS}.parseq.parseq_backbone", "PARSeqBackbone"): PARSEQ,
}

#: Causal LM backbones known to have no row, and why: said by NoLayoutError.
#: Any other backbone without a row gets the planner's layout (``hub/probe``).
NO_ROW: dict[tuple[str, str], str] = {}


class NoLayoutError(NotImplementedError):
    """A backbone with no known tensor-parallel layout."""


def rules_for(cls: type) -> tuple[Rule, ...] | None:
    """The rules of ``cls`` or of the nearest base class with a row."""
    keys = ((klass.__module__, klass.__qualname__) for klass in cls.__mro__)
    return next((ROWS[key] for key in keys if key in ROWS), None)


def get_layout_map(
    cls: type,
    device_mesh: Any,
    model_parallel_dim_name: str = "model",
    data_parallel_dim_name: str = "batch",
) -> Any:
    """``cls.get_layout_map(mesh)`` for a backbone with a row, as keras-hub's own."""
    import keras

    if not isinstance(device_mesh, keras.distribution.DeviceMesh):
        raise ValueError(
            "Invalid device_mesh type. Expected `keras.distribution.DeviceMesh`, "
            f"got {type(device_mesh)}"
        )
    for name in (model_parallel_dim_name, data_parallel_dim_name):
        if name not in device_mesh.axis_names:
            raise ValueError(
                f"{name!r} is not an axis of the device mesh "
                f"(its axes: {list(device_mesh.axis_names)}); pass "
                "model_parallel_dim_name= and data_parallel_dim_name= "
                "naming two of them"
            )
    rules = rules_for(cls)
    why = NO_ROW.get((cls.__module__, cls.__qualname__))
    if rules is None and why is None:
        from keras_dtensor_fix.hub import probe

        planned = probe.planned_layout_map(
            cls, device_mesh, model_parallel_dim_name, data_parallel_dim_name
        )
        if planned is not None:
            return planned
    if rules is None:
        raise NoLayoutError(
            f"keras-dtensor-fix knows no tensor-parallel layout for "
            f"{cls.__qualname__}. Plan one with keras_dtensor_fix.auto_layout_map("
            "lambda: Backbone(...), mesh), or write a keras.distribution.LayoutMap: "
            "its keys are re.fullmatch regexes over the variable paths "
            "(print [(v.path, v.shape) for v in backbone.weights]), its "
            "values one mesh axis name or None per weight axis."
            + (f" ({cls.__qualname__}: {why})" if why else "")
        )
    names = {MODEL: model_parallel_dim_name, DATA: data_parallel_dim_name}
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map.update((regex, tuple(map(names.get, axes))) for regex, axes in rules)
    return layout_map
