"""Local einsum: values and gradients on two ranks (its plan: test_planner.py).

``tests/ranks/einsum.py`` runs every case of its ``CASES`` on two gloo ranks
against ``torch.einsum`` on the full plain tensors (outputs and gradients);
here the pure parts are checked in-process.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from keras_dtensor_fix.dtensor.einsum import _grad_equations  # noqa: E402
from ranks.einsum import CASES, LINEAR_CASES  # noqa: E402
from support import ROOT, run_ranks  # noqa: E402


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
    megatron = {k: results.pop(k) for k in list(results) if k.startswith("megatron")}
    assert results == {**expected, "matmul": "local"}, results
    assert megatron and all(megatron.values()), megatron
