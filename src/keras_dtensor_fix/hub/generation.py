"""What sharded generation and blocks mode read of keras-hub's causal LMs.

Plain data and attribute reads: a keras-hub release that renames one is
fixed here.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CACHE_ARGUMENTS",
    "CACHE_HEADS",
    "CALL_WITH_CACHE",
    "decoder_blocks",
    "head_counts",
    "known_sampler",
    "token_embedding",
    "unknown_attention",
]

_HUB = "keras_hub.src"
_QKV = ("num_query_heads", "num_key_value_heads")
#: Attention layers whose cached call may run on a share of their heads
#: (``generation/decoder.py``): the attributes that count heads, each divided
#: by the number of ranks for that call. Gemma's ``hidden_dim`` only sets its
#: query scale (``hidden_dim // num_query_heads``), a ratio that must hold.
#: Keras's MultiHeadAttention (keras-hub's cached one) reads no head count in
#: its call. Any other attention layer keeps its block on DTensors.
ATTENTION_HEADS: dict[str, tuple[str, ...]] = {
    f"{_HUB}.models.gemma.gemma_attention.CachedGemmaAttention": (*_QKV, "hidden_dim"),
    f"{_HUB}.models.llama.llama_attention.LlamaAttention": _QKV,
    f"{_HUB}.models.qwen.qwen_attention.QwenAttention": _QKV,
    f"{_HUB}.models.qwen_moe.qwen_moe_attention.QwenMoeAttention": _QKV,
    f"{_HUB}.models.qwen3_moe.qwen3_moe_attention.Qwen3MoeAttention": _QKV,
    f"{_HUB}.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention": (),
}

#: The parameters every causal LM's ``call_with_cache`` starts with; those
#: after them differ (Gemma3's image embeddings and masks, Qwen3.5's
#: ``position_ids``) and are handed on as given (``generation/token_args``).
CALL_WITH_CACHE = ("token_ids", "cache", "cache_update_index")
#: A decoder block's cache: (batch, 2, length, heads, head dim); the heads axis.
CACHE_HEADS = -2
#: The keyword a decoder block takes its cache by (GPT-2's
#: ``TransformerDecoder``: ``self_attention_cache``).
CACHE_ARGUMENTS = ("cache", "self_attention_cache")
#: Samplers that pass each token call's cache to the next as it came back
#: (beam and contrastive search repeat and reorder it).
SAMPLERS = frozenset({"GreedySampler", "TopKSampler", "TopPSampler", "RandomSampler"})


def head_counts(layer: Any) -> tuple[str, ...] | None:
    """The head-count attributes of ``layer``'s class, or None if unknown."""
    cls = type(layer)
    return ATTENTION_HEADS.get(f"{cls.__module__}.{cls.__qualname__}")


def unknown_attention(layer: Any) -> bool:
    """Whether ``layer``'s class name says attention but it has no row in
    :data:`ATTENTION_HEADS`."""
    return "attention" in type(layer).__name__.lower() and head_counts(layer) is None


def known_sampler(model: Any) -> bool:
    """Whether a causal LM's sampler is one of keras-hub's :data:`SAMPLERS`."""
    cls = type(getattr(model, "sampler", None))
    return cls.__name__ in SAMPLERS and cls.__module__.startswith("keras_hub.")


def decoder_blocks(model: Any) -> list[Any]:
    """The blocks a causal LM's backbone lists (``transformer_layers``)."""
    backbone = getattr(model, "backbone", None)
    return list(getattr(backbone, "transformer_layers", None) or ())


def token_embedding(model: Any) -> Any:
    """A causal LM's token embedding layer, or None."""
    return getattr(getattr(model, "backbone", None), "token_embedding", None)
