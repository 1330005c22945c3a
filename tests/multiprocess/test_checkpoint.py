"""Sharded checkpoints (``keras_dtensor_fix.checkpoint``) on 2 ranks and one process.

``tests/ranks/checkpoint.py`` trains an MLP (column- and row-parallel Dense
kernels, a seeded Dropout, Adam) for 2 epochs with the ``Checkpoint``
callback, then resumes a fresh model from it for 2 more. Checked here:
resumed losses equal an uninterrupted 4-epoch run exactly on the same mesh,
and to 1e-5 after resharding (1, 2) -> (2, 1), 2 ranks -> one process with no
process group, and one process -> (1, 2); variables are written in place and
keep their placements; each rank writes only its own shards; a save's peak
memory stays below one variable's shard while a full gather (for scale) shows
up whole; bad inputs raise errors that name what is wrong; a save that dies
halfway leaves the previous checkpoint loadable. Controls that show the
checks can fail: resuming without the optimizer state gives other losses,
and ``get_weights()`` (a gather) is seen by the memory measurement.

``CHECKPOINT_FOUR_RANKS=1`` adds a (2, 2) mesh on 4 ranks (slow on 2 cores).

Upstream Keras (observed with ``KERAS_DTENSOR_FIX=0`` on 2 ranks, keras-nightly
3.16.0.dev2026102704) has no per-rank checkpoint. ``model.save_weights``
gathers every sharded variable (``DTensor.full_tensor()``, an all-gather) on
every rank and writes the whole model to an HDF5 file: with a path per rank
each rank writes a full copy (structural keys ``layers/dense/vars/0``, full
shapes); with one shared path, as a user would write it, one rank fails to
lock the file (``BlockingIOError: [Errno 11] Unable to synchronously create
file (unable to lock file ...)``) and the other hangs in the all-gather of the
first sharded kernel, waiting for it. ``keras.callbacks.OrbaxCheckpoint``
(from its source) converts a torch model's state to numpy, a full gather too,
and coordinates several processes on JAX only.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from support import ROOT, clean_env, run_ranks, timed_run

SCRIPT = ROOT / "tests" / "ranks" / "checkpoint.py"
TIMEOUT = 300
RTOL = 1e-5
SPLIT = 2
#: Fixed mmap threshold: freed large blocks go back to the OS, so the RSS
#: high-water mark sees every large allocation (glibc).
MALLOC = {"MALLOC_MMAP_THRESHOLD_": "65536"}


def results(out: Path, world: int) -> list[dict]:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for rank, steps in enumerate(ranks):
        for name, step in steps.items():
            failed = isinstance(step, dict) and "error" in step
            assert not failed, f"rank {rank} {name}: {step['traceback']}"
    return ranks


def launch(out: Path, *args: str, world: int, env: dict | None = None) -> list[dict]:
    """Run the rank script on ``world`` ranks (or one plain process)."""
    if world > 1:
        proc = run_ranks(SCRIPT, str(out), *args, nproc=world, env=env, timeout=TIMEOUT)
    else:
        proc = timed_run(
            [sys.executable, str(SCRIPT), str(out), *args],
            f"checkpoint.py x1 {args} {env}",
            env=clean_env({"OMP_NUM_THREADS": "1", **(env or {})}),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return results(out, world)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("checkpoint")


@pytest.fixture(scope="module")
def single(root) -> dict:
    """One process: train and save, bad inputs, a crash mid-save."""
    return launch(
        root / "single", "--train", "--errors", "--metrics", "--crash", world=1
    )[0]


@pytest.fixture(scope="module")
def sharded(root, single) -> list[dict]:
    """2 ranks on (1, 2): train and save, memory; resume resharded."""
    return launch(
        root / "sharded",
        "--train",
        "--memory",
        "--metrics",
        "--resume",
        f"{root / 'single' / 'ckpt'}@1,2",
        "--resume",
        f"{root / 'sharded' / 'ckpt'}@2,1",
        world=2,
        env={"CHECKPOINT_MESH": "1,2", **MALLOC},
    )


@pytest.fixture(scope="module")
def one_process(root, sharded) -> dict:
    """One process, no process group, resumed from the 2-rank checkpoint."""
    return launch(root / "one", "--resume", str(root / "sharded" / "ckpt"), world=1)[0]


def test_resume_is_exact_on_the_same_mesh(sharded, single) -> None:
    for rank, train in enumerate(r["train"] for r in [*sharded, single]):
        reference = train["reference"]
        assert train["first"] == reference[:SPLIT], rank
        resumed = train["resumed"]
        assert resumed["info"]["epoch"] == SPLIT and resumed["info"]["step"] == 8
        assert resumed["in_place"], "load replaced a variable or its storage"
        # Bit for bit: weights, Adam's slots, its iteration and the dropout
        # seed state all came back.
        assert resumed["losses"] == reference[SPLIT:], (rank, resumed, reference)
        assert train["listing"] == ["LATEST", "ckpt-000002"]  # keep=1
    assert sharded[0]["train"]["resumed"]["info"]["processes"] == 2


def test_resume_without_optimizer_state_differs(sharded) -> None:
    """Control: the comparison above sees a lost optimizer state."""
    train = sharded[0]["train"]
    difference = np.abs(np.subtract(train["no_optimizer"], train["reference"][SPLIT:]))
    assert difference.min() > 1e-3 * abs(train["reference"][-1]), train


def test_reshard_1x2_to_2x1(sharded) -> None:
    reference = sharded[0]["train"]["reference"]
    for rank in sharded:
        result = rank["resume"][1]
        assert result["info"]["processes"] == 2 and result["in_place"]
        kernel = result["placements"]["dense_1/kernel"]
        assert kernel["mesh"] == [2, 1] and kernel["local"] == [16, 32], kernel
        np.testing.assert_allclose(result["losses"], reference[SPLIT:], rtol=RTOL)


def test_one_process_into_sharded_model(sharded, single) -> None:
    reference = single["train"]["reference"]
    for rank in sharded:
        result = rank["resume"][0]
        assert result["info"]["processes"] == 1 and result["in_place"]
        kernel = result["placements"]["dense_1/kernel"]
        assert kernel["mesh"] == [1, 2] and kernel["local"] == [16, 16], kernel
        np.testing.assert_allclose(result["losses"], reference[SPLIT:], rtol=RTOL)


def test_sharded_into_one_process(one_process, sharded) -> None:
    result = one_process["resume"][0]
    assert result["info"]["processes"] == 2 and result["in_place"]
    assert result["placements"] == {}  # plain Parameters
    reference = sharded[0]["train"]["reference"]
    np.testing.assert_allclose(result["losses"], reference[SPLIT:], rtol=RTOL)


def test_each_rank_writes_its_own_shards(root, sharded) -> None:
    from torch.distributed.checkpoint import FileSystemReader

    directory = root / "sharded" / "ckpt"
    path = directory / (directory / "LATEST").read_text().strip()
    metadata = FileSystemReader(str(path)).read_metadata()
    files: dict[str, list[str]] = {}
    for index, info in metadata.storage_data.items():
        files.setdefault(index.fqn, []).append(info.relative_path)
    # A column-sharded kernel: one half from each rank's file.
    assert sorted(files["model/dense_1/kernel"]) == ["__0_0.distcp", "__1_0.distcp"]
    assert sorted(files["optimizer/dense_2/kernel/momentum"]) == [
        "__0_0.distcp",
        "__1_0.distcp",
    ]
    # A replicated bias and the iteration count: written once.
    assert len(files["model/dense_1/bias"]) == 1
    assert len(files["optimizer/iteration"]) == 1
    assert "model/drop/seed_generator_state" in files
    chunks = metadata.state_dict_metadata["model/dense_1/kernel"].chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (0, 16)]


def test_save_does_not_gather(sharded) -> None:
    for rank, result in enumerate(r["memory"] for r in sharded):
        if "skipped" in result:
            pytest.skip(result["skipped"])
        # Sanity: 8 kernels of 4 MiB, column-sharded over 2 ranks.
        assert result["full_bytes"] > 1.9 * result["shard_bytes"] > 30e6, result
        # Control: a full gather shows up whole in the measurement.
        assert result["gather_growth"] > 0.9 * result["full_bytes"], result
        # A save grows the resident set by less than one variable's local
        # shard (2 MiB): nothing is gathered, not even one variable at a time.
        assert result["save_growth"] < result["largest_shard"], (rank, result)


def test_bad_inputs_are_named(single) -> None:
    errors = single["errors"]
    mismatch = "CheckpointMismatchError"
    extra = errors["extra_layer"]
    assert extra["type"] == mismatch
    assert (
        "missing from the checkpoint: model/dense_4/bias, model/dense_4/kernel"
        in extra["message"]
    )
    missing = errors["missing_layer"]
    assert missing["type"] == mismatch
    assert (
        "in the checkpoint but not in the model: model/dense_3/bias"
        in missing["message"]
    )
    shape = errors["shape"]
    assert shape["type"] == mismatch
    assert "model/dense_1/kernel (saved (16, 32), model (16, 24))" in shape["message"]
    assert errors["no_directory"]["type"] == "FileNotFoundError"
    assert "does not exist" in errors["no_directory"]["message"]
    assert errors["empty_directory"]["type"] == "FileNotFoundError"
    assert "no complete checkpoint" in errors["empty_directory"]["message"]
    assert errors["no_optimizer_saved"]["type"] == "CheckpointError"
    assert "optimizer=False" in errors["no_optimizer_saved"]["message"]
    assert errors["bad_save_freq"]["type"] == "ValueError"
    assert "build it first" in errors["unbuilt"]["message"]


def test_metrics_round_trip(single, sharded) -> None:
    for result in (r["metrics"] for r in [single, *sharded]):
        assert result["count"] >= 4 and result["differed"] and result["equal"], result


def test_save_every_n_batches(single) -> None:
    # 4 batches an epoch, save_freq=3: saved after batch 3, no epoch complete.
    assert single["errors"]["int_save_freq"] == {"epoch": 0, "step": 3}


def test_crash_mid_save_keeps_the_previous_checkpoint(single) -> None:
    crash = single["crash"]
    assert crash["exit_code"] == 17, crash  # died inside the second save
    assert crash["listing"] == [".partial-ckpt-000002", "LATEST", "ckpt-000001"]
    assert crash["same_weights"] and crash["step"] == 4, crash
    # The next save replaces the leftover and the old checkpoint.
    assert crash["listing_after_save"] == ["LATEST", "ckpt-000002"]


@pytest.mark.skipif(
    os.environ.get("CHECKPOINT_FOUR_RANKS") != "1",
    reason="set CHECKPOINT_FOUR_RANKS=1 for the 4-rank (2, 2) mesh",
)
def test_four_ranks_2x2(root, sharded, single) -> None:
    ranks = launch(
        root / "four",
        "--resume",
        str(root / "sharded" / "ckpt"),
        "--resume",
        str(root / "single" / "ckpt"),
        world=4,
        env={"CHECKPOINT_MESH": "2,2"},
    )
    references = [sharded[0]["train"]["reference"], single["train"]["reference"]]
    for rank in ranks:
        for result, reference in zip(rank["resume"], references, strict=True):
            kernel = result["placements"]["dense_1/kernel"]
            assert kernel["mesh"] == [2, 2] and kernel["local"] == [16, 16]
            np.testing.assert_allclose(result["losses"], reference[SPLIT:], rtol=RTOL)
