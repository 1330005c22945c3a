"""Local einsum: the placement plan, and values and gradients on two ranks.

``tests/ranks/einsum.py`` runs every case of its ``CASES`` on two gloo ranks
against ``torch.einsum`` on the full plain tensors (outputs and gradients);
here the pure parts are checked in-process.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402

from keras_dtensor_fix.dtensor.einsum import _grad_equations, plan  # noqa: E402
from ranks.einsum import CASES, LINEAR_CASES  # noqa: E402
from support import ROOT, run_ranks  # noqa: E402

R = Replicate()


@pytest.mark.parametrize(
    ("equation", "shapes", "placements", "expected"),
    [
        # Column parallel: the replicated input's gradient is a partial sum.
        ("abk,kn->abn", ((4, 3, 6), (6, 8)), ((R,), (Shard(1),)),
         ((Shard(2),), ((Partial(),), (Shard(1),)))),
        # Row parallel: the output is a partial sum.
        ("abk,kn->abn", ((4, 3, 6), (6, 8)), ((Shard(2),), (Shard(0),)),
         ((Partial(),), ((Shard(2),), (Shard(0),)))),
        # Two mesh axes: one replicated everywhere, one sharding the heads.
        ("aecd,abcd->acbe", ((2, 5, 4, 3),) * 2, ((R, Shard(2)), (R, Shard(2))),
         ((R, Shard(1)), ((R, Shard(2)), (R, Shard(2))))),
    ],
)  # fmt: skip
def test_plan(equation, shapes, placements, expected) -> None:
    assert plan(equation, shapes, placements, (2,) * len(placements[0])) == expected


def test_plan_one_rank_axis() -> None:
    """A (1, 2) mesh's first axis holds everything on its one rank: keras-hub's
    layouts shard two letters on it, which is no obstacle there."""
    placements = ((Shard(2), Shard(2)), (Shard(1), Shard(0)))
    shapes = ((4, 3, 6), (6, 2, 8))
    found = plan("bqm,muh->bquh", shapes, placements, (1, 2))
    assert found == ((R, Partial()), placements)
    assert plan("bqm,muh->bquh", shapes, placements, (2, 2)) is None


@pytest.mark.parametrize(
    ("equation", "shapes", "placements"),
    [
        ("abk,kn->abn", ((4, 3, 6), (6, 8)), ((Shard(2),), (R,))),  # k unsharded in B
        ("ij,jk->ik", ((3, 4), (4, 5)), ((R,), (Shard(1),))),  # uneven
        ("ij,jk->ik", ((4, 4), (4, 6)), ((Partial(),), (R,))),  # Partial operand
        ("...k,kn->...n", ((4, 6), (6, 8)), ((R,), (Shard(1),))),  # ellipsis
        ("ik,kn->in", ((4, 1), (6, 8)), ((R,), (Shard(1),))),  # broadcast letter
        ("ii,ij->ij", ((4, 4), (4, 6)), ((R,), (Shard(1),))),  # repeated letter
        ("ij,jk->ik", ((4, 4), (4, 6)), ((Shard(0),), (Shard(1),))),  # two letters
    ],
)
def test_no_plan(equation, shapes, placements) -> None:
    assert plan(equation, shapes, placements, (2,)) is None


def test_grad_equations() -> None:
    assert _grad_equations("abk,kn->abn") == ("abn,kn->abk", "abn,abk->kn")
    # b is summed away and only A has it: autograd's einsum takes over.
    assert _grad_equations("abc,cd->ad") is None


def test_two_ranks() -> None:
    proc = run_ranks(ROOT / "tests" / "ranks" / "einsum.py")
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("CASES ")]
    results = json.loads(line[len("CASES ") :])
    expected = {name: "local" if c[3] else "fallback" for name, c in CASES.items()}
    expected.update(
        (name, "local" if c[-1] else "fallback") for name, c in LINEAR_CASES.items()
    )
    assert results == {**expected, "matmul": "local"}, results
