"""Models no layout was written for, sharded by ``auto_layout_map``.

A Sequential MLP, keras.io's transformer classifier (MultiHeadAttention), a
subclassed model of custom layers, a conv net with a dense head, an
MLP-Mixer block, keras-hub's BERT and ViT classifiers, its BART (a seq2seq
LM) and Gemma (a causal LM) train two epochs, evaluate and predict on 2 ranks
equal to one process, the layout planned inside the case after its seed is
set (``cases_planned.py``). Gemma trains on keras-hub's own map too, and the
two runs are equal. The default run takes the MLP and the transformer eager on
(1, 2), BERT eager, and the MLP compiled on (2, 1); the slow tier the rest and
the other keras-hub models.
On (1, 2) each rank holds at most 0.65x one process's weight bytes.

Upstream Keras (``KERAS_DTENSOR_FIX=0``) given the same planned layouts
(keras-nightly 3.16.0.dev2026102704): the MLP and the transformer train equal
to one process, their ``jit_compile=True`` cases eagerly ("Running without
torch.compile"); BERT fails in its first step ("The size of tensor a (4)
must match the size of tensor b (8)"), and so does BART on (1, 2); ViT, Gemma
and BART on (2, 1) train as one process.
"""

from __future__ import annotations

import pytest
from test_parity import assert_parity

from support import scenario_params

pytest.importorskip("keras_hub")

GROUP = "planned"


@pytest.mark.parametrize("name", scenario_params(GROUP))
def test_planned_parity(runs, name: str) -> None:
    ranks = runs.get(GROUP, world=2)
    assert_parity(name, ranks, runs.get(GROUP, world=1)[0])
    if name.endswith("_compiled"):  # for real: upstream runs these eagerly
        assert all(rank[name]["dynamo_graphs"] >= 1 for rank in ranks)
    if "_1x2" in name:
        for rank in ranks:
            result = rank[name]
            assert result["rank_bytes"] <= 0.65 * result["full_bytes"], result


#: What upstream does with the planned layouts, by case of the default run:
#: an error's fragment, or None: it trains as one process, eagerly.
UPSTREAM: dict[str, str | None] = {
    "planned_mlp_1x2": None,
    "planned_transformer_1x2": None,
    "planned_mlp_2x1_compiled": None,
    "planned_transformer_1x2_compiled": None,
    "planned_bert_1x2": "must match the size of tensor b",
}


@pytest.mark.slow  # upstream (KERAS_DTENSOR_FIX=0): the slow tier's launch
def test_upstream_planned(runs) -> None:
    assert_upstream(runs, UPSTREAM)


def assert_upstream(runs, pinned: dict[str, str | None]) -> None:
    """Upstream on the cases of ``pinned`` that this session runs."""
    upstream = runs.get(GROUP, world=2, KERAS_DTENSOR_FIX="0")[0]
    single = runs.get(GROUP, world=1)[0]
    for name, expected in pinned.items():
        if not runs.ran(name):
            continue
        if expected is not None:
            assert expected in upstream[name].get("error", ""), upstream[name]
            continue
        assert "error" not in upstream[name], upstream[name]["error"]
        assert upstream[name]["dynamo_graphs"] == 0  # compiled: eagerly
        assert upstream[name]["losses"] == pytest.approx(single[name]["losses"])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["1x2", "1x2_compiled", "2x1"])
def test_planned_as_own_map(runs, mesh: str) -> None:
    """Gemma on the planner's layout trains as on keras-hub's own map."""
    ranks = runs.get(GROUP, world=2)
    own = ranks[0][f"planned_gemma_own_map_{mesh}"]
    assert_parity(f"planned_gemma_{mesh}", ranks, {f"planned_gemma_{mesh}": own})


#: Upstream on the slow tier's keras-hub cases, as :data:`UPSTREAM`: ViT and
#: Gemma train as one process (their compiled cases eagerly), BART's (1, 2) cases
#: fail in their first step as BERT's does; on (2, 1) BART trains.
UPSTREAM_HUB: dict[str, str | None] = {
    "planned_vit_1x2": None,
    "planned_vit_1x2_compiled": None,
    "planned_vit_2x1": None,
    "planned_bart_1x2": "must match the size of tensor b",
    "planned_bart_1x2_compiled": "must match the size of tensor b",
    "planned_bart_2x1": None,
    "planned_gemma_1x2": None,
    "planned_gemma_own_map_1x2": None,
    "planned_gemma_1x2_compiled": None,
    "planned_gemma_own_map_1x2_compiled": None,
    "planned_gemma_2x1": None,
    "planned_gemma_own_map_2x1": None,
}


@pytest.mark.slow
def test_upstream_planned_hub(runs) -> None:
    assert_upstream(runs, UPSTREAM_HUB)
