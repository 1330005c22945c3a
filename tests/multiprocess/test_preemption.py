"""SIGTERM in any phase of ``fit``: every process stops at one step, saves it
before ``preemption_timeout``, and the next launch ends equal to a run that
was not stopped.

``tests/ranks/preempt.py`` is the user's script (2 processes, torchrun; the
signal goes to torchrun's agent, which forwards it to both). Each case stops
the job where the main thread is not at a step's end: in validation, in a
slow read of the training data, after steps of a few milliseconds became
0.4 s; the slow tier adds a slow epoch-end callback, a background save in
flight, 4 processes and two torchrun agents (the signal to one process only).
Checked: every process names the same step, the newest checkpoint holds it,
the job ended before the 5 s deadline, and the second launch's history
(validation too), weights and optimizer iterations equal one uninterrupted
process's. (Watching only at steps' ends, every few steps, each of these
ended at the deadline instead, with an older checkpoint.)

Upstream Keras (``KERAS_DTENSOR_FIX=0``) with ``keras.callbacks.
BackupAndRestore(save_freq=5)`` instead (keras-nightly 3.16.0.dev2026102704,
torch 2.13.0, observed): see :func:`test_upstream_backup_and_restore`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support import ROOT, clean_env, run_agents, run_ranks, timed_run

SCRIPT = ROOT / "tests" / "ranks" / "preempt.py"
TIMEOUT = 300
DEADLINE = 5.0  # the script's preemption_timeout
RTOL, ATOL = 1e-5, 1e-6
SLOW = pytest.mark.slow

#: case: the steps the processes may agree to stop after. Validation starts
#: after the epoch's 16 steps; the slow read is the 10th batch's (after 9);
#: the signal comes as step 13 begins, with another process maybe still in
#: step 12 (that one wins) or the sender already in 13.
CASES = {"validation": {16}, "data": {9}}
#: The slow tier's: the signal as a step begins (test_resume's SIGTERM too), a
#: slow epoch-end callback (after the 16 steps), the signal as step 11 begins
#: while step 10's background save is written.
SLOW_CASES = {"jump": {12, 13}, "callback": {16}, "save": {10, 11}}


def read(out: Path, rank: int, launch: int) -> dict:
    return json.loads((out / f"rank{rank}.launch{launch}.json").read_text())


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = timed_run(
        [sys.executable, str(SCRIPT), str(out)],
        "preempt.py x1",
        env=clean_env({"OMP_NUM_THREADS": "1"}),
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return read(out, 0, 0)


def check(reference: dict, final: dict) -> None:
    assert final["iterations"] == reference["iterations"] == 32
    assert sorted(final["history"]) == sorted(reference["history"])
    for name, values in reference["history"].items():
        np.testing.assert_allclose(final["history"][name], values, rtol=RTOL)
    for got, want in zip(final["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def launch(out: Path, env: dict, nproc: int, agents: bool) -> tuple[int, str]:
    """One launch: torchrun's exit code and output."""
    if agents:
        (a, b) = run_agents(SCRIPT, str(out), env=env, timeout=TIMEOUT)
        return a[0] or b[0], a[1] + b[1]
    proc = run_ranks(SCRIPT, str(out), env=env, nproc=nproc, timeout=TIMEOUT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "case",
    [*CASES, *(pytest.param(c, marks=SLOW) for c in SLOW_CASES)],
)
def test_signal_anywhere_stops_saves_and_resumes(tmp_path, reference, case) -> None:
    preempt_and_resume(tmp_path, reference, case)


@SLOW
@pytest.mark.skipif(
    os.environ.get("KERAS_DTENSOR_FIX_FOUR_RANKS") != "1",
    reason="4 processes: KERAS_DTENSOR_FIX_FOUR_RANKS=1 (nox -s tests4)",
)
def test_four_processes(tmp_path, reference) -> None:
    """Mesh (1, 4), the signal in validation."""
    preempt_and_resume(tmp_path, reference, "validation", nproc=4)


@SLOW
def test_two_agents(tmp_path, reference) -> None:
    """Two torchrun agents, one process each, as on two machines: process
    0's agent alone gets the signal and forwards it to process 0 alone; the
    other learns of it through the store."""
    preempt_and_resume(tmp_path, reference, "data", agents=True)


def preempt_and_resume(
    out: Path, reference: dict, case: str, nproc: int = 2, agents: bool = False
) -> None:
    env = {"PREEMPT_CASE": case}
    code, log = launch(out, env, nproc, agents)
    ended = time.time()
    assert code != 0, log[-4000:]
    assert "no step was saved within" not in log, log[-4000:]
    stopped = dict(
        (int(r), int(s))
        for r, s in re.findall(r"SIGTERM: process (\d) stopped after step (\d+)", log)
    )
    assert sorted(stopped) == list(range(nproc)), log[-4000:]
    (step,) = set(stopped.values())
    assert step in {**CASES, **SLOW_CASES}[case], (step, log[-4000:])
    # The agent's own shutdown included: before the deadline would have come.
    took = ended - float((out / "signal.time").read_text())
    assert took < DEADLINE, f"{took:.1f} s from the signal to the job's end"
    ckpt = out / "ckpt"
    latest = ckpt / (ckpt / "LATEST").read_text().strip()
    info = json.loads((latest / "keras_checkpoint.json").read_text())
    assert info["position"]["batches"] == step, info["position"]["batches"]
    code, log = launch(out, {**env, "PREEMPT_LAUNCH": "1"}, nproc, agents)
    assert code == 0, log[-6000:]
    for rank in range(nproc):
        final = read(out, rank, 1)
        epoch, batch = divmod(step, 16)
        assert final["trained"][0] == [epoch, batch], final["trained"][:2]
        check(reference, final)


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=SLOW) for c in ("validation", "data", "jump")],
)
def test_upstream_backup_and_restore(tmp_path, case) -> None:
    """Upstream never gets to the signal: at the first backup (step 5) both
    processes write the one ``latest.weights.h5`` (h5py's file lock refuses
    the second, or the folder is made twice), the job fails, and the file is
    left empty or truncated, so the next launch fails reading it (3 of 3
    cases, each run twice, observed)."""
    env = {"PREEMPT_CASE": case, "PREEMPT_UPSTREAM": "1", "KERAS_DTENSOR_FIX": "0"}
    first = run_ranks(SCRIPT, str(tmp_path), env=env, timeout=TIMEOUT)
    log = first.stdout + first.stderr
    assert first.returncode != 0, log[-4000:]
    assert not (tmp_path / "signal.time").exists()  # it failed before
    for rank in range(2):
        assert read(tmp_path, rank, 0)["trained"][-1] == [0, 4]
    second = run_ranks(
        SCRIPT, str(tmp_path), env={**env, "PREEMPT_LAUNCH": "1"}, timeout=TIMEOUT
    )
    log = second.stdout + second.stderr
    assert second.returncode != 0, log[-4000:]
    assert "Unable to synchronously open file" in log, log[-4000:]
