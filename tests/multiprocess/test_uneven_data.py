"""Processes that feed uneven data under ModelParallel raise, on every
process, before the step that would hang (``checks/feeds.py``).

Upstream (``KERAS_DTENSOR_FIX=0``) and the plugin before this check hang in
``fit()`` when one process feeds fewer batches (the others wait in the step's
first collective until gloo's 30-minute timeout), and run an uneven last
batch or another batch size silently. Each case of ``tests/ranks/uneven.py``
runs in one launch: uneven counts, last batch, batch size, a generator
(counted batch by batch), validation, ``predict``, counts that differ under
``steps_per_epoch`` (the second epoch), eager and compiled, on (2, 1) and
(1, 2); the even cases (arrays, a generator, ``steps_per_epoch``) equal one
process. The rank script's watchdog and the launch's timeout bound a hang.
"""

from __future__ import annotations

import json
import os

import pytest

from support import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "ranks" / "uneven.py"
FOUR = os.environ.get("KERAS_DTENSOR_FIX_FOUR_RANKS") == "1"

#: case -> (the reason the error names, each process's line in it).
UNEVEN = {
    "fewer_batches": (
        "the number of batches differs",
        ["process 0: 10 batches of 8 rows", "process 1: 6 batches of 8 rows"],
    ),
    "fewer_batches_compiled": (
        "the number of batches differs",
        ["process 0: 10 batches of 8 rows", "process 1: 6 batches of 8 rows"],
    ),
    "short_last_batch": (
        "the last batch's size differs",
        [
            "process 0: 10 batches of 8 rows\n",
            "process 1: 10 batches of 8 rows, the last of 6",
        ],
    ),
    "other_batch_size": (
        "the batch size differs",
        ["process 0: 10 batches of 8 rows", "process 1: 20 batches of 4 rows"],
    ),
    "generator_fewer_batches": (
        "one process ran out of batches while another had one",
        ["process 0: batch 7 of 8 rows", "process 1: no batch left after 6 batches"],
    ),
    "generator_fewer_batches_compiled": (
        "one process ran out of batches while another had one",
        ["process 0: batch 7 of 8 rows", "process 1: no batch left after 6 batches"],
    ),
    "uneven_validation": (
        "the number of batches differs",
        ["process 0: 4 batches of 8 rows", "process 1: 2 batches of 8 rows"],
    ),
    "uneven_predict": (
        "the number of batches differs",
        ["process 0: 4 batches of 8 rows", "process 1: 3 batches of 8 rows"],
    ),
    "steps_per_epoch_second_epoch": (
        "one process began a new pass over its data",
        [
            "process 0: batch 7 of 8 rows",
            "process 1: 6 batches of 8 rows, steps_per_epoch=5",
        ],
    ),
}
EVEN = (
    "even_arrays",
    "even_generator",
    "even_generator_compiled",
    "even_steps_per_epoch",
)
TWO = [
    *(f"{name}@2,1" for name in UNEVEN),
    "fewer_batches@1,2",
    "generator_fewer_batches@1,2",
    *(f"{name}@2,1" for name in EVEN),
    *(f"{name}@1,2" for name in EVEN),
]


def launch(out, cases: list[str], nproc: int) -> list[dict]:
    proc = run_ranks(SCRIPT, str(out), *cases, nproc=nproc, timeout=420)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> list[dict]:
    return launch(tmp_path_factory.mktemp("uneven2"), TWO, 2)


@pytest.fixture(scope="module")
def one(tmp_path_factory) -> dict:
    return launch(tmp_path_factory.mktemp("uneven1"), [f"{n}@1,1" for n in EVEN], 1)[0]


def assert_uneven(ranks: list[dict], case: str, name: str) -> None:
    why, lines = UNEVEN[name]
    for rank in ranks:
        result = rank[case]
        assert result["type"] == "UnevenDataError", result
        message = result["message"]
        assert message.startswith("keras-dtensor-fix: under ModelParallel"), message
        assert why in message, message
        for line in lines:
            assert line in message, (line, message)
        assert "What to do: feed every process the same number of batches" in message


@pytest.mark.parametrize("name", list(UNEVEN))
def test_uneven_data_raises_on_every_process(two, name) -> None:
    assert_uneven(two, f"{name}@2,1", name)


@pytest.mark.parametrize("name", ["fewer_batches", "generator_fewer_batches"])
def test_uneven_data_raises_on_1x2(two, name) -> None:
    """On (1, 2) both processes feed the whole batch: different data hangs too."""
    assert_uneven(two, f"{name}@1,2", name)


@pytest.mark.parametrize("mesh", ["2,1", "1,2"])
@pytest.mark.parametrize("name", EVEN)
def test_even_data_equals_one_process(two, one, name, mesh) -> None:
    reference = one[f"{name}@1,1"]
    assert reference["type"] == "no error", reference
    for rank in two:
        result = rank[f"{name}@{mesh}"]
        assert result["type"] == "no error", result
        assert result["result"].keys() == reference["result"].keys()
        for key, losses in reference["result"].items():
            assert result["result"][key] == pytest.approx(losses, rel=1e-5), key


@pytest.mark.skipif(not FOUR, reason="4 processes: KERAS_DTENSOR_FIX_FOUR_RANKS=1")
def test_four_ranks_2x2(tmp_path, one) -> None:
    """On (2, 2) the first two processes feed one half of each batch, the
    last two the other; process 0 feeds more than the other three."""
    names = ["fewer_batches", "generator_fewer_batches", "fewer_batches_compiled"]
    ranks = launch(tmp_path, [*(f"{n}@2,2" for n in names), "even_arrays@2,2"], 4)
    for name in names:
        why, _ = UNEVEN[name]
        for rank in ranks:
            result = rank[f"{name}@2,2"]
            assert result["type"] == "UnevenDataError", result
            assert why in result["message"] and "process 3: " in result["message"]
    for rank in ranks:
        result = rank["even_arrays@2,2"]["result"]
        for key, losses in one["even_arrays@1,1"]["result"].items():
            assert result[key] == pytest.approx(losses, rel=1e-5), key
