"""Planning 7B-parameter models without their weights: time and peak memory.

Gemma-7B's shapes (28 layers, hidden 3072, 16 heads of 256, FFN 24576,
vocabulary 256000: 8.5e9 parameters, 34 GB in float32) and Llama-3-8B's (32
layers, hidden 4096, 32 query and 8 key-value heads, FFN 14336, vocabulary
128256: 8.0e9) planned by ``keras_dtensor_fix.auto_layout_map`` on a (1, 8)
mesh: built on torch's ``meta`` device, one forward traced. Prints one JSON
line per model: the seconds the call took, the process's peak resident
memory so far (``getrusage``), the device it planned on and the plan's
summary. ``python benchmarks/plan_7b.py``.
"""

from __future__ import annotations

import json
import os
import resource
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import keras_hub  # noqa: E402

import keras_dtensor_fix  # noqa: E402

GEMMA_7B = {
    "vocabulary_size": 256000,
    "num_layers": 28,
    "num_query_heads": 16,
    "num_key_value_heads": 16,
    "hidden_dim": 3072,
    "intermediate_dim": 49152,  # keras-hub's: twice the FFN width (gate and up)
    "head_dim": 256,
}


LLAMA_3_8B = {
    "vocabulary_size": 128256,
    "num_layers": 32,
    "num_query_heads": 32,
    "num_key_value_heads": 8,
    "hidden_dim": 4096,
    "intermediate_dim": 14336,
}
MODELS = {
    "gemma_7b": (keras_hub.models.GemmaBackbone, GEMMA_7B),
    "llama_3_8b": (keras_hub.models.LlamaBackbone, LLAMA_3_8B),
}


def main(name: str) -> dict:
    cls, config = MODELS[name]
    devices = [f"cpu:{i}" for i in range(8)]  # named, never started
    mesh = keras.distribution.DeviceMesh((1, 8), ["batch", "model"], devices)
    started = time.perf_counter()
    layout_map = keras_dtensor_fix.auto_layout_map(lambda: cls(**config), mesh)
    seconds = time.perf_counter() - started
    plan = layout_map.plan
    return {
        "model": name,
        "seconds": round(seconds, 1),
        "peak_rss_gb": round(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, 2
        ),
        "device": plan.traced.device,
        "parameters": sum(plan.traced.nbytes.values()) // 4,
        "rules": len(layout_map),
        "summary": plan.summary(),
    }


if __name__ == "__main__":
    for model in MODELS:
        print(json.dumps(main(model)))
