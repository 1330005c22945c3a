"""A job killed, signalled or restarted resumes at its step, equal to one that was not.

``tests/ranks/resume.py`` is the user's script: 2 processes, a Megatron MLP
with a seeded Dropout, Adam, ``fit`` for 2 epochs of 16 batches with
``Checkpoint(save_freq=5)``. Each case starts the process group its own way,
feeds its own kind of data and meets its own fault once; torchrun restarts
the group (or a second launch starts it again). Checked: every attempt
connects; the resumed attempt begins at the batch after a checkpoint
(nothing the checkpoint holds is trained again: the first batch it trains is
one after a save or the preemption's step), and its weights, optimizer
iterations and logged epoch losses equal the uninterrupted run's (one process
for unshuffled data; 2 processes for shuffled data, whose order Keras makes
differently on one process).

Upstream Keras (``KERAS_DTENSOR_FIX=0``, keras-nightly 3.16.0.dev2026102704,
torch 2.13.0, observed): it trains this model, but a restart under torchrun
fails in most runs, whether Keras or torch starts the group ("Gloo
connectFullMesh failed ... Connection refused" inside ``init_process_group``:
torch's rendezvous reuses the agent's store with no attempt in its keys), in
6 of 9 runs reported for ``init_process_group("gloo")`` then Keras's
``initialize``; and ``Checkpoint`` refuses to resume inside an epoch, since
no patch reaches ``fit``'s data iterator (the last test).
Keras's own ``BackupAndRestore`` restarts the epoch, by its design.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest

from support import ROOT, clean_env, run_agents, run_ranks, timed_run

SCRIPT = ROOT / "tests" / "ranks" / "resume.py"
TIMEOUT = 300
RTOL, ATOL = 1e-5, 1e-6
SAVE_FREQ, AT, BATCHES = 5, 13, 32


def read(out: Path, rank: int, launch: int, attempt: int) -> dict:
    return json.loads(
        (out / f"rank{rank}.launch{launch}.attempt{attempt}.json").read_text()
    )


def stopped_at(log: str, world: int) -> int:
    """The one step every process says it stopped after."""
    said = re.findall(r"SIGTERM: process (\d) stopped after step (\d+)", log)
    assert sorted(int(r) for r, _ in said) == list(range(world)), log[-4000:]
    steps = {int(s) for _, s in said}
    assert len(steps) == 1, log[-4000:]
    return steps.pop()


def uninterrupted(out: Path, data: str, world: int) -> dict:
    env = {"RESUME_DATA": data, "RESUME_SAVE_FREQ": "1000"}
    if world == 1:
        proc = timed_run(
            [sys.executable, str(SCRIPT), str(out)],
            f"resume.py x1 {env}",
            env=clean_env({"OMP_NUM_THREADS": "1", **env}),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
    else:
        proc = run_ranks(SCRIPT, str(out), env=env, timeout=TIMEOUT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return read(out, 0, 0, 0)


class References(dict):
    """Uninterrupted runs by data kind, each launched when a test first asks:
    one process (numpy, PyDataset), 2 (shuffled, the loader)."""

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, data: str) -> dict:
        world = 2 if data in ("shuffle", "loader") else 1
        self[data] = uninterrupted(self.root / data, data, world)
        return self[data]


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> References:
    return References(tmp_path_factory.mktemp("uninterrupted"))


def check(reference: dict, final: dict, first: list[int] | None = None) -> None:
    """``final`` (the resumed attempt) ends where ``reference`` does."""
    begin = final["trained"][0]
    step = begin[0] * 16 + begin[1]  # batches done when the attempt began
    assert step > 0, f"trained from the start again: {final['trained'][:3]}"
    assert step % SAVE_FREQ == 0 or (first is not None and begin == first), begin
    assert final["iterations"] == reference["iterations"] == BATCHES
    done = len(final["history"]["loss"])
    for name in ("loss", "mae"):
        np.testing.assert_allclose(
            final["history"][name], reference["history"][name][-done:], rtol=RTOL
        )
    for got, want in zip(final["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


CASES = {
    # id: (group started by, data, fault, process, torchrun's restarts). The
    # slow tier (nox -s full) has the three that vary only how the group
    # starts and what feeds it: the default run keeps each fault once (a kill
    # mid-step, mid-write and mid-restore, SIGTERM to one process mid-step).
    "kill-keras-numpy": ("keras", "numpy", "kill", "1", 1),
    "kill-torch-shuffle": ("torch", "shuffle", "kill", "1", 1),
    "kill-torch-gloo-pydataset": ("torch_gloo", "pydataset", "kill", "0", 1),
    "kill-torch-then-keras-loader": ("torch_keras", "loader", "kill", "1", 1),
    "write-device-mesh": ("mesh", "numpy", "write", "1", 1),
    "restore-torch": ("torch", "numpy", "restore", "1", 2),
    "term-one-process": ("torch", "numpy", "term", "1", 1),
}


SLOW = (
    "kill-torch-shuffle",
    "kill-torch-gloo-pydataset",
    "kill-torch-then-keras-loader",
)


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in CASES]
)
def test_restart_resumes_at_the_step(tmp_path, references, case: str) -> None:
    """torchrun restarts the group after the fault; fit resumes at the step.

    ``write`` kills a process as a checkpoint write starts (the other is
    inside it); ``restore`` kills one inside the restarted attempt's load
    (a third attempt resumes); ``term`` sends SIGTERM to one process alone:
    both stop after the same step, save it and exit 143, and the restart
    resumes right after it.
    """
    init, data, fault, rank, restarts = CASES[case]
    env = {
        "RESUME_INIT": init,
        "RESUME_DATA": data,
        "RESUME_FAULT": fault,
        "RESUME_KILL_RANK": rank,
        "RESUME_BACKGROUND": "1" if data == "shuffle" else "0",
    }
    proc = run_ranks(
        SCRIPT,
        str(tmp_path),
        env=env,
        timeout=TIMEOUT,
        launcher=(f"--max-restarts={restarts}",),
    )
    log = (proc.stdout + proc.stderr)[-8000:]
    assert proc.returncode == 0, log
    first = None
    if fault == "term":
        # Process 1 signals itself as step 13 begins and stops before it;
        # process 0 may already be in step 13: then both stop after it.
        step = stopped_at(log, 2)
        assert step in (12, 13), log
        first = [0, step]
    for r in range(2):
        died = read(tmp_path, r, 0, 0)
        assert died["trained"][-1][1] < 15 and "history" not in died, died["trained"]
        check(references[data], read(tmp_path, r, 0, restarts), first)


@pytest.mark.slow  # test_preemption signals the agent by default
def test_sigterm_to_the_agent_then_a_new_launch(tmp_path, references) -> None:
    """A scheduler's SIGTERM: torchrun forwards it to both; the next launch resumes."""
    env = {"RESUME_FAULT": "agent", "RESUME_KILL_RANK": "0", "RESUME_DATA": "loader"}
    first = run_ranks(SCRIPT, str(tmp_path), env=env, timeout=TIMEOUT)
    log = first.stdout + first.stderr
    assert first.returncode != 0, log[-4000:]
    # The agent forwards the signal while process 0 begins step 13: the
    # processes stop after 12, or after 13 if one was in it by then (or 14,
    # if one was in 14). Either way every process stops after the same step
    # and saves it.
    step = stopped_at(log, 2)
    assert step >= 12, log[-4000:]
    latest = (tmp_path / "ckpt" / "LATEST").read_text().strip()
    assert f"after step {step} (epoch 1, batch {step}); saved " in log, log[-4000:]
    assert f"{latest}: the next launch resumes there" in log, (latest, log[-4000:])
    second = run_ranks(
        SCRIPT, str(tmp_path), env={**env, "RESUME_LAUNCH": "1"}, timeout=TIMEOUT
    )
    assert second.returncode == 0, (second.stdout + second.stderr)[-6000:]
    for r in range(2):
        check(references["loader"], read(tmp_path, r, 1, 0), [0, step])


@pytest.mark.skipif(
    os.environ.get("KERAS_DTENSOR_FIX_FOUR_RANKS") != "1",
    reason="4 processes: KERAS_DTENSOR_FIX_FOUR_RANKS=1 (nox -s tests4)",
)
@pytest.mark.parametrize("fault", ["kill", "term"])
def test_four_processes(tmp_path, references, fault: str) -> None:
    """Mesh (1, 4); process 2 is killed, or alone gets SIGTERM; restarted."""
    env = {"RESUME_INIT": "torch", "RESUME_FAULT": fault, "RESUME_KILL_RANK": "2"}
    proc = run_ranks(
        SCRIPT,
        str(tmp_path),
        env=env,
        nproc=4,
        timeout=TIMEOUT,
        launcher=("--max-restarts=1",),
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-8000:]
    first = [0, stopped_at(log, 4)] if fault == "term" else None
    for r in range(4):
        check(references["numpy"], read(tmp_path, r, 0, 1), first)


@pytest.mark.parametrize(
    "fault", ["kill", pytest.param("term", marks=pytest.mark.slow)]
)
def test_one_process_then_a_new_launch(tmp_path, references, fault: str) -> None:
    """No process group: killed, or SIGTERM (saved at once, exit 143); the
    next launch resumes at the step, bit for bit."""
    command = [sys.executable, str(SCRIPT), str(tmp_path)]
    env = {"OMP_NUM_THREADS": "1", "RESUME_FAULT": fault, "RESUME_KILL_RANK": "0"}
    for launch, code in (("0", 17 if fault == "kill" else 143), ("1", 0)):
        proc = timed_run(
            command,
            f"resume.py x1 {fault} launch {launch}",
            env=clean_env({**env, "RESUME_LAUNCH": launch}),
            capture_output=True,
            text=True,
            timeout=TIMEOUT,
        )
        assert proc.returncode == code, (proc.stdout + proc.stderr)[-4000:]
    final = read(tmp_path, 0, 1, 0)
    # SIGTERM as step 13 begins: saved after 12, before training 13.
    check(references["numpy"], final, [0, 12] if fault == "term" else None)
    assert final["weights"] == references["numpy"]["weights"]


@pytest.mark.slow  # test_saving runs two agents by default
def test_two_agents(tmp_path, references) -> None:
    """Two torchrun agents (c10d rendezvous), one process each, as on two
    machines; one process is killed and both agents restart theirs. Each
    agent counts its own restarts (one restarting for its peer's new round
    keeps 0), so the attempt in the store keys is the rendezvous round, which
    the agents share."""
    env = {"RESUME_INIT": "torch", "RESUME_FAULT": "kill", "RESUME_KILL_RANK": "1"}
    agents = run_agents(
        SCRIPT, str(tmp_path), env=env, launcher=("--max-restarts=1",), timeout=TIMEOUT
    )
    assert [code for code, _ in agents] == [0, 0], (
        agents[0][1][-4000:] + agents[1][1][-4000:]
    )
    for r in range(2):
        final = max(tmp_path.glob(f"rank{r}.launch0.attempt*.json"))
        check(references["numpy"], json.loads(final.read_text()))


@pytest.mark.slow  # test_saving runs two agents by default
def test_elastic_a_machine_lost(tmp_path, references) -> None:
    """``--nnodes=1:2``: the second machine is lost (its agent and process
    SIGKILLed as batch 13 begins). The first agent's next rendezvous round
    has one process; the script's mesh, built from ``list_devices()``, is
    (1, 1), and ``Checkpoint`` reshards the 2-process checkpoint onto it and
    resumes at the step. (The first agent hosts the rendezvous store: a job
    whose store host is lost cannot go on, in torch's design.)"""
    env = {"RESUME_INIT": "torch", "RESUME_FAULT": "lose"}
    agents = run_agents(
        SCRIPT,
        str(tmp_path),
        env=env,
        # How long a round that has its minimum of machines waits for more:
        # 8 s, not torchrun's 30 (the second agent joins the first round
        # within the stagger and its own start, about 5 s; the survivor's
        # round waits it out).
        launcher=("--max-restarts=1", "--rdzv_conf=last_call_timeout=8"),
        timeout=TIMEOUT,
        nnodes="1:2",
        each=({"RESUME_KILL_RANK": "none"}, {"RESUME_KILL_RANK": "all"}),
        stagger=3.0,
    )
    survivor, lost = agents
    assert survivor[0] == 0 and lost[0] != 0, survivor[1][-4000:] + lost[1][-2000:]
    final = read(tmp_path, 0, 0, 1)
    assert final["world"] == 1, final.get("world")
    check(references["numpy"], final)


@pytest.mark.slow
def test_upstream_refuses_to_resume_inside_an_epoch(tmp_path) -> None:
    """With the plugin off nothing skips the saved batches: a clear error, not
    a silent second training of them. (Two launches, not a restart: upstream's
    restart fails to connect in most runs, before it gets there.)"""
    env = {"RESUME_FAULT": "kill", "KERAS_DTENSOR_FIX": "0"}
    first = run_ranks(SCRIPT, str(tmp_path), env=env, timeout=TIMEOUT)
    assert first.returncode != 0  # the kill
    assert (tmp_path / "ckpt" / "LATEST").read_text().strip() == "ckpt-000002"
    env["RESUME_LAUNCH"] = "1"
    second = run_ranks(SCRIPT, str(tmp_path), env=env, timeout=TIMEOUT)
    log = second.stdout + second.stderr
    assert second.returncode != 0
    assert "Checkpoint cannot resume inside an epoch here" in log, log[-4000:]
    assert "save_freq='epoch'" in log
