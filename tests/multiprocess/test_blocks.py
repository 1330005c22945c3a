"""``KERAS_DTENSOR_FIX_COMPILE=blocks``: each repeated block compiled once.

With ``jit_compile=True`` and the mode set, the step runs eagerly on 2 ranks
and every decoder block runs one graph compiled for its class: the GPT
decoder's 4 ``TransformerDecoder`` blocks (the default run); in the slow tier
the 2 blocks of Llama, Gemma and QwenMoe under their own ``get_layout_map``
(QwenMoe's router loss leaves each region through ``add_loss``; Gemma with
inductor: under ``aot_eager`` torch's backward graph fails on a size-1
dimension's stride). The layers after the last block (the head) and the loss
run as one more region (``compiled/tail.py``) in every training step, and the
optimizer's update block by block (``compiled/update_groups.py``): Adam's
update is per variable, so one graph updates every block's variables and
one the rest. Each must equal one eager process (losses, weights, greedy
tokens; the GPT case's accuracy too, computed on the region's output) with
exactly four dynamo graphs: the block's ``call``, the tail and two of
``Adam.update``, nothing else compiled (the loss-scaled case: two, its
update eager). Each
block's calls skip dynamo's guards once a step of them compiled nothing
(``compiled/region.Steady``): the GPT decoder's 4 blocks do by its last steps.
Megatron's "f" of each block's input runs inside the block's graph, and the
vocabulary-split head's inside the tail's: none is made eagerly (4 in the GPT
case's 4 steps with the tail eager, ``no-tail`` in ``blocks_steps.py``; 20 with the "f"
of each block made before its region too, as the mode did before).

Can it fail: with Keras's name scope left open inside the region each block
compiles its own graph (its sublayers' paths are guarded), 4 graphs for the
GPT decoder; with Megatron's "f" set inside the region on the block's input
itself (a tensor from outside the graph) the backward fails ("Expected a
DTensor tangent but got a plain Tensor"); with the "f" made eagerly (the
mode before) ``eager_f`` counts 20; with the ``compile`` family off nothing
compiles (upstream's behaviour, below).

Upstream (``KERAS_DTENSOR_FIX=0``) ignores the mode and runs the step eagerly
("Running without torch.compile"), and fails on these models: GPT "must match
the size of tensor b", Llama and QwenMoe "Unable to automatically build",
Gemma's generate() "placement changes are not supported".
"""

from __future__ import annotations

import pytest
from cases_fallback import BLOCK_FALLBACKS
from test_hub import assert_upstream_fails, check
from test_parity import assert_parity

from support import scenario_params

pytest.importorskip("keras_hub")

#: The class each case's blocks have.
BLOCK = {
    "gpt_4_layers_blocks": "TransformerDecoder",
    "gpt_blocks_loss_scaled": "TransformerDecoder",
    "gpt_blocks_adamw": "TransformerDecoder",
    "llama_blocks": "LlamaTransformerDecoder",
    "gemma_blocks": "GemmaDecoderBlock",
    "qwen_moe_blocks": "QwenMoeTransformerDecoder",
}


@pytest.mark.parametrize(
    "name",
    scenario_params("blocks", leave_out=(*BLOCK_FALLBACKS, "gpt_blocks_evaluate")),
)
def test_blocks_compile_once(runs, name: str) -> None:
    ranks, single = runs.get("blocks", world=2), runs.get("blocks", world=1)[0]
    if "tokens" in single[name]:
        check(name, ranks, single)
    else:
        assert_parity(name, ranks, single)
    for result in ranks:
        compiled = result[name]["compiled"]
        tails = [qualname for qualname in compiled if qualname.endswith(".tail")]
        assert len(tails) == 1, compiled
        block, update = f"{BLOCK[name]}.call", UPDATE.get(name, "Adam.update")
        assert compiled == sorted([block, *tails, *([update] if update else [])])
        assert result[name]["dynamo_graphs"] == GRAPHS.get(name, 4)
        calls = result[name]["calls"]
        # every training step (two epochs of two batches) ran its head and
        # loss as the tail's region, and its update per block and the rest
        assert calls[tails[0]] == STEPS, calls
        if update:
            assert calls[update] == STEPS + calls[block], calls
        # every case compiles an accuracy (keras-hub's CausalLM by default):
        # the tail's region updates it, its argmax fused with the log-softmax;
        # eagerly only at the model's build
        assert result[name]["eager_metric_updates"] <= 1
        assert result[name]["graph_breaks"] == 0
        assert result[name]["plugin_warnings"] == []
        assert result[name].get("restored", True)  # generate() left the regions
        if name in SETTLED:  # at least every block's call in one step
            assert result[name]["unguarded"].get(block, 0) >= SETTLED[name]
        if name in EAGER_F:
            assert result[name]["eager_f"] == EAGER_F[name]
        how = "block by block: " + WHY.get(name, "KERAS_DTENSOR_FIX_COMPILE=blocks")
        assert any(how in line for line in result[name]["why"])


#: The optimizer's compiled update, where not Adam's per block (None: eager,
#: a branching update).
UPDATE = {"gpt_blocks_loss_scaled": None, "gpt_blocks_adamw": "AdamW.update"}
#: Dynamo graphs, where not four (the update per block: the blocks' and the
#: rest's); an eager update none.
GRAPHS = {"gpt_blocks_loss_scaled": 2}


#: Blocks whose calls skipped their guards by ``fit()``'s last step.
SETTLED = {"gpt_4_layers_blocks": 4}


#: Why each case compiled block by block (``status()``'s note), where not
#: the mode set: the GPT case runs the default (``auto``).
WHY = {
    "gpt_4_layers_blocks": "the default for repeated blocks (4 TransformerDecoder)",
    "gpt_blocks_loss_scaled": "the default for repeated blocks (2 TransformerDecoder)",
    "gpt_blocks_adamw": "the default for repeated blocks (2 TransformerDecoder)",
}


#: Megatron "f" ops made eagerly during ``fit()``: none, the head's is in the
#: tail's graph (4, one a step, with the tail eager).
EAGER_F = {"gpt_4_layers_blocks": 0}
#: Training steps of every case (``fit()``: two epochs of two batches): each
#: one's head and loss ran as the tail's region, and its update as its own.
STEPS = 4


@pytest.mark.slow
def test_blocks_evaluate_compiles_whole(runs) -> None:
    """By default a model with repeated blocks trains block by block, and its
    validation, ``evaluate()`` and ``predict()`` steps compile whole (grad-free
    blocks run their own call: in ``blocks`` mode those steps run eagerly).
    Equal to one process; every graph but the block's is a step's forward;
    no break, no warning. Before, the default made those steps eager: the
    only graph was the block's. The blocks' dropout compiles too, each mask
    one op of the block's graph drawn as one process draws it. Before, the
    eager draw was a graph break inside each block, torch's backward refused
    the split graph ("Expected a DTensor tangent but got a plain Tensor")
    and the step ran eagerly, warned, its masks no longer one process's; and
    until each epoch iterated one process's ``DataLoader``, ``fit()``'s masks
    differed from one process's. Upstream fails (:data:`UPSTREAM`)."""
    name = "gpt_blocks_evaluate"
    ranks, single = runs.get("blocks", world=2), runs.get("blocks", world=1)[0]
    assert_parity(name, ranks, single)
    for result in ranks:
        assert "TransformerDecoder.call" in result[name]["compiled"]
        assert len(result[name]["compiled"]) > 1, result[name]["compiled"]
        assert result[name]["graph_breaks"] == 0
        assert result[name]["plugin_warnings"] == []
        assert any("this step has no backward" in line for line in result[name]["why"])


#: What upstream does on each case (the first line of its error).
UPSTREAM = {
    "gpt_4_layers_blocks": "must match the size of tensor b",
    "llama_blocks": "Unable to automatically build",
    "gemma_blocks": "placement changes are not supported",
    "qwen_moe_blocks": "Unable to automatically build",
    "gpt_blocks_compile_raises": "must match the size of tensor b",
    "gpt_blocks_backward_raises": "must match the size of tensor b",
    "gpt_blocks_evaluate": "in-place operations that require placement changes",
    "gpt_blocks_loss_scaled": "must match the size of tensor b",
    "gpt_blocks_adamw": "must match the size of tensor b",
}


@pytest.mark.slow  # upstream (KERAS_DTENSOR_FIX=0): the slow tier's launch
def test_upstream_blocks(runs) -> None:
    assert_upstream_fails(runs, "blocks", UPSTREAM)


@pytest.mark.parametrize(
    "name",
    [  # a backward failing at run time: the slow tier's
        pytest.param(n, marks=pytest.mark.slow) if "backward" in n else n
        for n in sorted(BLOCK_FALLBACKS)
    ],
)
def test_blocks_fall_back(runs, name: str) -> None:
    """A compiled block that fails (``cases_fallback.py``, two GPT decoder
    blocks): its compilation raising sends its class to its own ``call``
    (``compiled/blocks.py``), its backward raising at run time in the first step
    runs that step again eagerly (the ``compile`` family's fallback). Every
    process warns once, naming the cause, and trains as upstream's eager
    step does, one process's losses and weights. Without the fallbacks
    fit() raised the error (a step run again with the block still compiled
    failed the same way). Upstream fails on this model as on
    ``gpt_4_layers_blocks`` (:data:`UPSTREAM`)."""
    ranks, single = runs.get("blocks", world=2), runs.get("blocks", world=1)[0]
    assert_parity(name, ranks, single)
    for rank, result in enumerate(ranks):
        warned = result[name]["plugin_warnings"]
        expected = BLOCK_FALLBACKS[name]
        assert len(warned) == len(expected), (rank, warned)
        for fragment, warning in zip(expected, warned, strict=True):
            assert fragment in warning, (rank, warned)
