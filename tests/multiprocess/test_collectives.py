"""ModelParallel steps run as few collectives as Megatron-style tensor parallel.

Counted on two ranks with torch's profiler (``cases_collectives.py``), for
the benchmark's models, eager and compiled. The MLP (column- then row-parallel
Dense) needs one all-reduce per step: the row-parallel output. The transformer
block needs three: the attention and FFN row-parallel outputs, and the
column-parallel layers' input gradient in the backward pass. Upstream Keras
runs 12 and 45; leaving a matmul's Partial sum unreduced costs one more
all-reduce in the backward pass. Compiled steps add one: the metric
variables' sum over the batch axis, coalesced into one all-reduce (Keras runs
one per variable), which the compiled step keeps even over a one-process batch
axis (see ``keras_dtensor_fix.patches.data``).

Tiny keras-hub CausalLMs (2 layers) sharded by their own
``get_layout_map`` on (1, 2) run what Megatron needs for that layout,
counted by hand (benchmarks/method.md). Gemma: 11 (per layer the attention
and FFN row-parallel sums and the column-parallel inputs' gradients, the
vocabulary-sharded lookup, the tied head's input gradient, one all-gather of
the logits for both the loss and the accuracy metric). It ran 17 without
Megatron's "f" (``dtensor.reducing_gradient``: each norm scale's gradient
came back Partial and took its own all-reduce) and 12 when the metric
gathered the logits again. Llama: 17 (its layout shards Q/K/V on the
contracted hidden axis: per layer 3 Q/K/V sums, the attention output and
FFN sums, then in the backward the all-gather of the Q/K/V input's gradient,
of the attention output's and the FFN input's sum; plus the lookup). It ran
21 when Q, K and V each split the replicated input for themselves, each
split's backward gathering its own gradient (``dtensor.placed`` shares one).
Upstream runs 105 on Gemma and cannot build Llama.

Compiled, the same models run the eager count plus the metric all-reduce
(above), counted by the ``hub_compiled`` scenario cases during ``fit()``'s last
epoch (``cases_hub.CountCollectives``; Llama's and GPT's in the slow tier):
the suite compiles each model once, with one decoder block
(``cases_hub.COMPILED_LAYERS``), so the per-layer counts above are taken
once: Gemma 4 + 3, Llama 8 + 1, GPT 4 + 2.
Before the optimizer's wrapper ran in the trace (``traced=True``) and the
traced "f" (``reducing_gradient`` as ``redistribute`` to the same placements),
Gemma's compiled step ran 28 and Llama's 30: Adam reduced each Partial norm-
scale gradient three times (in its momentum, its ``grad * grad`` and its
velocity). Gemma ran one more while a traced ``convert_to_tensor`` handed the
metric another object than the loss's logits, so ``dtensor.placed`` could not
give it the loss's gathered copy.

The same run counts the ops an eager step dispatches on DTensors: dense
layers run on local tensors (``keras_dtensor_fix.patches.layers``), ops on
replicated values that need no gradient too (``numpy`` family), and the loss
stays a plain tensor (``replicated`` family). That leaves 4 per MLP step,
autograd's detaches of the DTensor parameters' gradients, as torch's own
tensor parallel has them (25 with the layers family off). Norms, softmax and
rotary embeddings run on local tensors too (``leaves`` family): the
transformer block dispatches 19 (39 with the leaves family off), tiny Gemma
156 (398), Llama 81 (292), the GPT decoder 72 (122). GPT (2 keras_hub
TransformerDecoder blocks, Megatron layout) runs 10 collectives: 4 per block,
the column-parallel head's input gradient, the logits' all-gather.
"""

from __future__ import annotations

import importlib.util

import pytest
from cases_hub import COMPILED_LAYERS

from support import scenario_params

MEGATRON = {"mlp": 1, "transformer": 3}
#: Tiny keras-hub models, counted by hand (see the docstring): collectives
#: per decoder block, and those of the rest of the step.
PER_LAYER = {"gemma": (4, 3), "llama": (8, 1), "gpt": (4, 2)}
EXTRA = {"eager": 0, "compiled": 1}
#: Eager with 2 blocks (``cases_collectives.py``); compiled with the scenario
#: cases' blocks, plus the metric all-reduce.
HUB = {
    f"{model}/{config}": block * layers + rest + EXTRA[config]
    for model, (block, rest) in PER_LAYER.items()
    for config, layers in (("eager", 2), ("compiled", COMPILED_LAYERS))
}
#: COMPILED_BOUND: a compiled keras-hub step runs at most its HUB count. The
#: count depends on the backend, the bound does not: Gemma's step, which its
#: scenario case compiles with inductor, runs 12; under aot_eager (the other
#: cases' backend) it ran 11, one fewer (measured 2026-11-26).

#: Most DTensor-dispatched ops per eager step.
DTENSOR_OPS = {"mlp": 4, "transformer": 20, "gemma": 160, "llama": 85, "gpt": 75}


#: The compiled keras-hub steps: counted by these scenario cases (the suite
#: compiles each model once), which test_hub.py compares with one process.
HUB_COMPILED = {
    "gemma/compiled": "gemma_1x2_compiled",
    "llama/compiled": "llama_1x2_compiled",
    "gpt/compiled": "gpt_1x2_compiled",
}


@pytest.mark.parametrize("name", scenario_params("collectives"))
def test_collectives_per_step(runs, name: str) -> None:
    counts = dict(runs.get("collectives", world=2)[0][name])
    assert "error" not in counts, counts.get("traceback")
    hub = importlib.util.find_spec("keras_hub") is not None
    compiled = runs.get("hub_compiled", world=2)[0] if hub else {}
    for key, case in HUB_COMPILED.items():
        if not (hub and runs.ran(case)):  # Llama's and GPT's: the slow tier's
            counts[key] = None
            continue
        assert "error" not in compiled[case], compiled[case].get("traceback")
        counts[key] = compiled[case]["collectives"]
    extras = dict(EXTRA)
    if counts["compiles"]:
        assert counts["dynamo_graphs"] > 0, "the compiled steps fell back to eager"
    else:  # early nightlies: the plugin builds "compiled" steps eagerly
        assert counts["dynamo_graphs"] == 0
        extras["compiled"] = extras["eager"]
    for model, expected in MEGATRON.items():
        for config, extra in extras.items():
            assert counts[f"{model}/{config}"] == expected + extra, (model, counts)
        assert counts[f"{model}/dtensor_ops"] <= DTENSOR_OPS[model], counts
    for name, expected in HUB.items():
        if counts[name] is not None:  # keras-hub installed
            if name.endswith("compiled"):
                if counts["compiles"]:  # at most: see COMPILED_BOUND
                    assert counts[name] <= expected, (name, counts)
                continue
            assert counts[name] == expected, (name, counts)
    for model in ("gemma", "llama", "gpt"):
        ops = counts[f"{model}/dtensor_ops"]
        if ops is not None:
            assert ops <= DTENSOR_OPS[model], (model, counts)
