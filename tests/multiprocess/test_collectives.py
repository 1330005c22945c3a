"""ModelParallel steps run as few collectives as Megatron-style tensor parallel.

Counted on two ranks with torch's profiler (``tests/ranks/collectives.py``), for
the benchmark's models, eager and compiled. The MLP (column- then row-parallel
Dense) needs one all-reduce per step: the row-parallel output. The transformer
block needs three: the attention and FFN row-parallel outputs, and the
column-parallel layers' input gradient in the backward pass. Upstream Keras
runs 12 and 45; leaving a matmul's Partial sum unreduced costs one more
all-reduce in the backward pass. Compiled steps add one: the metric
variables' sum over the batch axis, coalesced into one all-reduce (Keras runs
one per variable), which the compiled step keeps even over a one-process batch
axis (see ``keras_dtensor_fix.patches.data``).

A tiny keras-hub GemmaCausalLM (2 layers) sharded by its own
``get_layout_map`` on (1, 2) runs 12 per eager step: by hand, Megatron needs
11 (per layer the attention and FFN row-parallel sums and the column-parallel
inputs' gradients, the vocabulary-sharded lookup, the tied head's input
gradient, the logits' all-gather for the loss). Without Megatron's "f"
(``dtensor.reducing_gradient``) it ran 17: each norm scale's gradient came
back Partial and took its own all-reduce. Upstream runs 105.

The same run counts the ops an eager step dispatches on DTensors: dense
layers run on local tensors (``keras_dtensor_fix.patches.layers``), ops on
replicated values that need no gradient too (``numpy`` family), and the loss
stays a plain tensor (``replicated`` family). That leaves 4 per MLP step,
autograd's detaches of the DTensor parameters' gradients, as torch's own
tensor parallel has them (25 with the layers family off), and 39 per
transformer step (64).
"""

from __future__ import annotations

import json

from support import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "ranks" / "collectives.py"
MEGATRON = {"mlp": 1, "transformer": 3}
GEMMA = 12  # the hand count, 11, plus one
EXTRA = {"eager": 0, "compiled": 1}
#: Most DTensor-dispatched ops per eager step.
DTENSOR_OPS = {"mlp": 4, "transformer": 40}


def test_collectives_per_step(tmp_path) -> None:
    out = tmp_path / "collectives.json"
    proc = run_ranks(SCRIPT, str(out), timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    counts = json.loads(out.read_text())
    extras = dict(EXTRA)
    if counts["compiles"]:
        assert counts["graphs"] > 0, "the compiled steps fell back to eager"
    else:  # early nightlies: the plugin builds "compiled" steps eagerly
        assert counts["graphs"] == 0
        extras["compiled"] = extras["eager"]
    for model, expected in MEGATRON.items():
        for config, extra in extras.items():
            assert counts[f"{model}/{config}"] == expected + extra, (model, counts)
        assert counts[f"{model}/dtensor_ops"] <= DTENSOR_OPS[model], counts
    if counts["gemma/eager"] is not None:  # keras-hub installed
        assert counts["gemma/eager"] == GEMMA, counts
