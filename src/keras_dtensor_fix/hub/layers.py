"""keras-hub leaf layers the ``leaves`` family knows, beside Keras's own.

:data:`MIXING_LAYERS`: layers that read across only some axes of their
input, by ``(module, class)``, with their kind (as
``engine.targets.MIXING_LAYERS`` for Keras's).
"""

from __future__ import annotations

_HUB = "keras_hub.src"
MIXING_LAYERS: dict[tuple[str, str], str] = {
    (f"{_HUB}.layers.modeling.rotary_embedding", "RotaryEmbedding"): "rotary",
    (f"{_HUB}.models.llama.llama_rotary_embedding", "LlamaRotaryEmbedding"): "rotary",
}
