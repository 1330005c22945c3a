"""What sharded generation needs to know of keras-hub's causal LMs.

The attention layers whose cached call may run on a share of their heads
(:data:`ATTENTION_HEADS`), the samplers that pass the cache on untouched
(:data:`SAMPLERS`), ``call_with_cache``'s first parameters
(:data:`CALL_WITH_CACHE`), a block's cache (:data:`CACHE_HEADS`,
:data:`CACHE_ARGUMENTS`), and where a causal LM keeps its decoder blocks and
token embedding. Plain data and attribute reads: a keras-hub release that
renames one is fixed here.
"""

from __future__ import annotations

from typing import Any

_HUB = "keras_hub.src"
#: keras-hub attention layers whose cached call may run on a share of their
#: heads (``generation/decoder.py``), and the attributes that count heads there: each
#: is divided by the number of ranks for that call. Gemma's ``hidden_dim``
#: only sets its query scale (``hidden_dim // num_query_heads``), a ratio
#: that must not change. keras's MultiHeadAttention (keras-hub's cached one)
#: reads no head count in its call: its einsum equations carry none. Any
#: other attention layer keeps its block on the DTensor path.
ATTENTION_HEADS: dict[str, tuple[str, ...]] = {
    f"{_HUB}.models.gemma.gemma_attention.CachedGemmaAttention": (
        "num_query_heads",
        "num_key_value_heads",
        "hidden_dim",
    ),
    f"{_HUB}.models.llama.llama_attention.LlamaAttention": (
        "num_query_heads",
        "num_key_value_heads",
    ),
    f"{_HUB}.models.qwen.qwen_attention.QwenAttention": (
        "num_query_heads",
        "num_key_value_heads",
    ),
    f"{_HUB}.models.qwen_moe.qwen_moe_attention.QwenMoeAttention": (
        "num_query_heads",
        "num_key_value_heads",
    ),
    f"{_HUB}.models.qwen3_moe.qwen3_moe_attention.Qwen3MoeAttention": (
        "num_query_heads",
        "num_key_value_heads",
    ),
    f"{_HUB}.layers.modeling.cached_multi_head_attention.CachedMultiHeadAttention": (),
}

#: The parameters every keras-hub causal LM's ``call_with_cache`` starts with.
#: Those after them differ and are passed by keyword: Gemma3's and Gemma4's
#: ``img_embeddings``, masks and ``cache_update_mask`` (Gemma4's audio too),
#: Qwen3.5's ``padding_mask`` and ``position_ids``; generation hands them on
#: as given (``generation/token_args.py``).
CALL_WITH_CACHE = ("token_ids", "cache", "cache_update_index")
#: A decoder block's cache: (batch, 2, length, heads, head dim); the heads axis.
CACHE_HEADS = -2
#: The keyword a decoder block takes its cache by: the causal LMs' own blocks
#: ``cache``, keras-hub's ``TransformerDecoder`` (GPT-2) ``self_attention_cache``.
CACHE_ARGUMENTS = ("cache", "self_attention_cache")

#: keras-hub samplers that pass each token call's cache to the next call as
#: it came back (beam and contrastive search repeat and reorder it).
SAMPLERS = frozenset({"GreedySampler", "TopKSampler", "TopPSampler", "RandomSampler"})


def head_counts(layer: Any) -> tuple[str, ...] | None:
    """The head-count attributes of ``layer``'s class, or None if unknown."""
    cls = type(layer)
    return ATTENTION_HEADS.get(f"{cls.__module__}.{cls.__qualname__}")


def unknown_attention(layer: Any) -> bool:
    """Whether ``layer`` looks like attention (by its class name) yet has no
    row in :data:`ATTENTION_HEADS`: its head counts are unknown."""
    name = type(layer).__name__.lower()
    return "attention" in name and head_counts(layer) is None


def known_sampler(model: Any) -> bool:
    """Whether a causal LM's sampler is one of keras-hub's :data:`SAMPLERS`."""
    cls = type(getattr(model, "sampler", None))
    return cls.__name__ in SAMPLERS and cls.__module__.startswith("keras_hub.")


def decoder_blocks(model: Any) -> list[Any]:
    """A causal LM's decoder blocks (its backbone's ``transformer_layers``)."""
    backbone = getattr(model, "backbone", None)
    return list(getattr(backbone, "transformer_layers", None) or ())


def token_embedding(model: Any) -> Any:
    """A causal LM's token embedding layer, or None."""
    return getattr(getattr(model, "backbone", None), "token_embedding", None)
