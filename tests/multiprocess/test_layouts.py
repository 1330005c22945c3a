"""keras-hub causal LMs sharded by the ``layouts`` family's ``get_layout_map``.

Twenty backbones that ship no ``get_layout_map`` (``hub/layouts.py``) train
two epochs with ``fit()`` and generate greedily on 2 ranks, meshes (1, 2)
and (2, 1), equal to one process (losses, weights, tokens).

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


@pytest.mark.slow
def test_rwkv7_compiled_runs_eagerly_warned(runs) -> None:
    """torch.compile fails on RWKV-7's step; it runs eagerly, warned, equal to
    one process (``test_layout_parity``), never raising."""
    name = "rwkv7_1x2_layout_compiled"
    for rank in runs.get("layouts", world=2):
        assert any(
            "runs eagerly" in w and "as_strided" in w for w in rank[name]["warned"]
        ), rank[name]["warned"]


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


def test_upstream_fails_the_same_layouts(runs) -> None:
    _upstream_fails(runs, slow=False)


@pytest.mark.slow
def test_upstream_fails_the_same_layouts_batch_split(runs) -> None:
    """The (2, 1) cases, Gemma4, PaliGemma, Gemma3n, BLIP2, PARSeq and compiled
    RWKV-7 (``upstream_slow``)."""
    _upstream_fails(runs, slow=True)
