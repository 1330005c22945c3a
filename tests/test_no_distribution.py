"""Do no harm: one process, no distribution, the plugin on and off alike.

The ``.pth`` activates the plugin in every Keras-on-torch process, sharded or
not, so a script that never sets a distribution must get exactly what
upstream Keras gives it: the same losses, evaluation, predictions and
weights, the same number of dynamo graphs and graph breaks (no extra
compilation), no error where upstream has none and no warning of ours.
``ranks/no_distribution.py`` runs every case (every optimizer Keras ships,
each optimizer feature, ``steps_per_execution``, a custom ``train_step``,
the callbacks; eager, and a few compiled) in one child per side: the plugin
on, and ``KERAS_DTENSOR_FIX=0``. Both children run at once.

``gemma-generate-jit`` (keras-hub's ``generate()`` with ``jit_compile=True``,
which upstream runs eagerly on torch) compiled 13 graphs, with 7 graph breaks,
while the ``generate`` family compiled tokens unsharded too.

Before the fix in ``engine/wrappers.py`` (a method patch installed as a wrapt
proxy on the class), ``accumulate-jit`` failed with the plugin only: dynamo
raised "Guard failed on the same frame it was created ... ClosureGuardAccessor:
Not a function" on ``TorchParallelOptimizer._backend_increment_gradient_accumulators``.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from support import ROOT, clean_env, last_json

RUNNER = ROOT / "tests" / "ranks" / "no_distribution.py"
SIDES = {"on": {}, "off": {"KERAS_DTENSOR_FIX": "0"}}
sys.path.insert(0, str(RUNNER.parent))
from no_distribution_cases import CASES, SLOW  # noqa: E402

sys.path.remove(str(RUNNER.parent))
#: Cases the runner runs by default (it leaves out the SLOW ones).
NAMES = [name for name in CASES if name not in SLOW]
NUMBERS = ("loss", "evaluate", "predict")


@pytest.fixture(scope="module")
def sides(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """Each side's report, both children started at once."""
    procs = {}
    for side, env in SIDES.items():
        out = tmp_path_factory.mktemp(f"no_distribution_{side}")
        full = clean_env({**env, "TORCHINDUCTOR_VEC_ISA_OK": "0"})
        procs[side] = subprocess.Popen(
            [sys.executable, str(RUNNER), str(out)],
            env=full,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=str(ROOT),
        )
    reports = {}
    for side, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        reports[side] = last_json(done)
    return reports


def test_the_sides_are_what_they_say(sides: dict[str, dict]) -> None:
    assert sides["on"]["active"] is True
    assert sides["off"]["active"] is False
    assert sides["on"]["cases"].keys() == sides["off"]["cases"].keys()


@pytest.mark.parametrize("name", NAMES)
def test_the_plugin_changes_nothing(sides: dict[str, dict], name: str) -> None:
    on, off = sides["on"]["cases"].get(name), sides["off"]["cases"].get(name)
    if on is None and off is None:
        pytest.skip(f"{name}: this Keras lacks the optimizer")
    assert off["error"] is None, f"upstream fails {name}: {off['error']}"
    assert on["error"] is None, f"{name} fails with the plugin only: {on['error']}"
    assert on["plugin_warnings"] == [], "a warning of ours without a distribution"
    assert (on["graphs"], on["graph_breaks"]) == (off["graphs"], off["graph_breaks"])
    assert on["iterations"] == off["iterations"]
    for key in NUMBERS:
        np.testing.assert_allclose(on[key], off[key], rtol=1e-6, atol=1e-6)
    assert len(on["weights"]) == len(off["weights"])
    for mine, theirs in zip(on["weights"], off["weights"], strict=True):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-6)
