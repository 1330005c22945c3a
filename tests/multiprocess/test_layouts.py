"""keras-hub causal LMs sharded by the ``layouts`` family's ``get_layout_map``.

Twenty backbones that ship no ``get_layout_map`` (``hub/layouts.py``) train
two epochs with ``fit()`` and generate greedily on 2 ranks, meshes (1, 2)
and (2, 1), equal to one process (losses, weights, tokens). The slow tier
compiles each on (1, 2) (``jit_compile=True``, ``test_layout_compiled``),
against one eager process, or one compiled process for the models whose
compiled training differs from their eager one without any distribution
(``cases_layouts.COMPILED_NUMERICS``);
upstream fails those as it fails the eager cases (GPT-2 and OPT: "must match
the size of tensor b" within a second).

Upstream Keras (``KERAS_DTENSOR_FIX=0``) has no ``get_layout_map`` on these
backbones; given the same layouts (built from ``hub/layouts.py`` directly)
it fails every case of the default run, keras-nightly 3.16.0.dev2026102704:
the sharded KV cache's ``index_put_`` (Gemma3, Gemma4, PaliGemma; Mixtral,
Falcon, Bloom on (2, 1)), the batch-split prompt's ``index_put_`` (Gemma3n),
"must match the size of tensor b" (GPT-2, OPT, GPT-NeoX, PARSeq; Mistral on
(2, 1)),
a Partial norm's ``add_`` (SmolLM3), a sharded ``_unsafe_view`` (GPT-OSS on
(2, 1)), no sharding strategy for CPU flash attention's backward (BLIP2, after
100 s), "as_strided not supported with DTensor" (RWKV-7: its time mix writes
each step's DTensor output into a plain tensor, its promotion mode lets the
write through, and the write's backward takes a view of a DTensor gradient),
failed assertions and build errors (the rest). The plugin without its
``fori_loop`` fix fails RWKV-7 earlier, on the write (DTensor's own
``AssertionError``).
"""

from __future__ import annotations

import pytest
from test_hub import cases, check

from support import scenario_params

pytest.importorskip("keras_hub")


@pytest.mark.parametrize("name", scenario_params("layouts"))
def test_layout_parity(runs, name: str) -> None:
    ranks = runs.get("layouts", world=2)
    check(name, ranks, runs.get("layouts", world=1)[0])
    assert all(rank[name]["get_layout_map"] for rank in ranks)  # the family's


#: A phase that runs eagerly without a warning (RWKV-7's own generate loop,
#: which the plugin does not compile) or compiles around graph breaks without
#: one (PARSeq's token step reads a scalar back: ``_local_scalar_dense``).
EAGER, BREAKS = "eager", "breaks"
_QWEN3_5 = {
    # the linear attention's step: graph breaks in its convolutions' wrapped
    # ops (inspect's Signature.bind under dynamo), then a DTensor output
    # aliasing an input across one (pytorch/pytorch#184002); predict()
    # compiles around the same breaks, warned
    "fit": "as_strided not supported with DTensor",
    "predict": "graph break(s) (mapping proxy affected by dictionary mutation",
}
#: kind -> phase (``fit``, ``predict`` or ``generate``) -> what it does where
#: it does not compile cleanly: a fragment of the warning each process gives
#: (a fallback to eager, a recompile, graph breaks), or :data:`EAGER` /
#: :data:`BREAKS`. The other phases compile with no warning and no break.
COMPILED_FALLBACKS: dict[str, dict[str, str]] = {
    # the time mix's in-place writes traced: a DTensor view (torch 2.13)
    "rwkv7": {
        "fit": "as_strided not supported with DTensor",
        "predict": "as_strided not supported with DTensor",
        "generate": EAGER,
    },
    "qwen3_5": _QWEN3_5,
    "qwen3_5_moe": _QWEN3_5,
    # its step with the ViT's blocks and Gemma's: a DTensor tangent guessed
    # wrong in a backward; predict() compiles around Qwen3.5's breaks, warned
    # (BLIP-2's and PARSeq's predict() compile: all three met dynamo's
    # recursion limit when these were pinned)
    "pali_gemma": {
        "fit": "we encountered a tensor subclass where we guessed",
        "predict": _QWEN3_5["predict"],
    },
    "parseq": {"generate": BREAKS},
    # the per-layer inputs' step compiles again on its second call
    "gemma3n": {"fit": "compiled again on call 2"},
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", [n for n in cases("layouts") if n.endswith("_layout_compiled")]
)
def test_layout_compiled(runs, name: str) -> None:
    """``jit_compile=True`` on (1, 2): the training step compiles (block by
    block), and ``predict()`` and ``generate()``'s token step compile, with
    no graph break and no fallback warning, equal to one process
    (``test_layout_parity``); a phase torch cannot compile
    (:data:`COMPILED_FALLBACKS`) runs eagerly, warned, never raising.
    Without ``blocks._tangents_ready`` Gemma4's step fell back to eager
    ("Expected a DTensor tangent but got a plain Tensor": its blocks return
    their KV cache, unused in training); without the ``normalized`` handler
    SmolLM3's blocks, predict step and token step all did (torch's
    ``rms_norm`` of hidden states split on the one-rank batch axis). Upstream
    compiles nothing under ModelParallel and fails as its eager cases do
    (``test_upstream_fails_the_same_layouts_batch_split``)."""
    kind = name.removesuffix("_1x2_layout_compiled")
    expected = COMPILED_FALLBACKS.get(kind, {})
    for rank in runs.get("layouts", world=2):
        assert "error" not in rank[name], rank[name].get("traceback")
        for phase, seen in rank[name]["phases"].items():
            want = expected.get(phase)
            if want == EAGER:
                assert seen["warned"] == [] and seen["graphs"] == 0, (phase, seen)
            elif want == BREAKS:
                assert seen["warned"] == [] and seen["graph_breaks"] > 0, seen
            elif want is not None:
                assert seen["warned"], (phase, seen)
                assert all(want in w for w in seen["warned"]), seen
            else:
                assert seen["warned"] == [], (phase, seen["warned"])
                assert seen["graphs"] >= 1, (phase, "ran eagerly")
                assert seen["graph_breaks"] == 0, (phase, seen["break_reasons"])


def _upstream_fails(runs, slow: bool) -> None:
    from scenarios import CASES

    upstream = runs.get("layouts", world=2, KERAS_DTENSOR_FIX="0")[0]
    ran = [
        name
        for name in cases("layouts")
        if runs.ran(name) and bool(CASES[name].get("upstream_slow")) == slow
    ]
    assert ran
    for name in ran:
        assert upstream[name].get("error"), name
        for kind, error in UPSTREAM_ERRORS.items():
            if name.startswith(f"{kind}_"):
                assert error in upstream[name]["error"], (name, upstream[name])


#: kind -> what upstream's error says, where one cause is pinned.
UPSTREAM_ERRORS = {
    "rwkv7": "as_strided not supported with DTensor",
    # an attention's backward: DTensor has no rule for CPU flash attention's
    "blip2": "does not have a sharding strategy registered",
    "parseq": "must match the size of tensor b",
}


@pytest.mark.slow  # upstream (KERAS_DTENSOR_FIX=0): the slow tier's launch
def test_upstream_fails_the_same_layouts(runs) -> None:
    _upstream_fails(runs, slow=False)


@pytest.mark.slow
def test_upstream_fails_the_same_layouts_batch_split(runs) -> None:
    """The (2, 1) cases, Gemma4, PaliGemma, Gemma3n, BLIP2, PARSeq and every
    compiled case (``upstream_slow``): upstream compiles nothing under
    ModelParallel and fails each compiled case as its eager twin, within 20 s
    (keras-nightly 3.16.0.dev2026102704)."""
    _upstream_fails(runs, slow=True)
