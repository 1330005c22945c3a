"""Local einsum: values and gradients on two ranks (its plan: test_planner.py).

``tests/ranks/einsum.py`` runs every case of its ``CASES`` on two gloo ranks
against ``torch.einsum`` on the full plain tensors (outputs and gradients);
here the pure parts are checked in-process.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from keras_dtensor_fix.dtensor.einsum import (  # noqa: E402
    _grad_equations,
    batched_equation,
)
from ranks.einsum import CASES, LINEAR_CASES  # noqa: E402
from support import ROOT, run_ranks  # noqa: E402


def test_grad_equations() -> None:
    assert _grad_equations("abk,kn->abn") == ("abn,kn->abk", "abn,abk->kn")
    # b is summed away and only A has it: autograd's einsum takes over.
    assert _grad_equations("abc,cd->ad") is None


@pytest.mark.parametrize(
    ("left", "right"),
    [
        ((2, 1, 2, 1, 8), (2, 1, 1, 8, 12)),  # Gemma4's grouped attention logits
        ((3, 4, 5), (3, 5, 6)),
        ((2, 3, 4, 5), (3, 5, 6)),
        ((1, 3, 4, 5), (2, 1, 5, 6)),
    ],
)
def test_batched_equation_is_matmul(left, right) -> None:
    """A batched matmul as one einsum, broadcast batch dims and all (a size-1
    dim gets a letter of its own, summed over its one element)."""
    x, w = torch.randn(left), torch.randn(right)
    equation = batched_equation(left, right)
    torch.testing.assert_close(torch.einsum(equation, x, w), x @ w)


def test_batched_equation_refuses() -> None:
    assert batched_equation((3, 4, 5), (2, 5, 6)) is None  # 3 and 2 do not broadcast
    assert batched_equation((3, 4, 5), (3, 4, 6)) is None  # k differs
    assert batched_equation((4, 5), (3, 5, 6)) is None  # a 2-d operand: mm's case


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
    megatron = {k: results.pop(k) for k in list(results) if k.startswith("megatron")}
    assert results == {**expected, "matmul": "local"}, results
    assert megatron and all(megatron.values()), megatron
