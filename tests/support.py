"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PATCHES = SRC / "keras_dtensor_fix" / "patches"

RunPy = Callable[..., subprocess.CompletedProcess]

#: (seconds, what) of every process launch this pytest session timed: the
#: terminal summary lists the longest (where the suite's time goes).
LAUNCHES: list[tuple[float, str]] = []


#: Lines a test wants in the terminal summary (what it measured, not asserted).
NOTES: list[str] = []


def timed_run(command: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(command, **kwargs)``, its wall time noted in LAUNCHES."""
    start = time.perf_counter()
    try:
        return subprocess.run(command, **kwargs)
    finally:
        LAUNCHES.append((time.perf_counter() - start, what))


def scenario_params(group: str, leave_out: tuple[str, ...] = ()) -> list:
    """The scenario cases of ``group`` but ``leave_out`` as pytest parameters,
    a case registered ``slow=True`` marked ``slow`` (``nox -s tests`` leaves
    those out, ``nox -s full`` runs them)."""
    import pytest
    from scenarios import CASES

    return [
        pytest.param(name, marks=pytest.mark.slow) if spec.get("slow") else name
        for name, spec in CASES.items()
        if spec["group"] == group and name not in leave_out
    ]


def compiles_model_parallel() -> bool:
    """Whether this Keras can compile a ModelParallel step (>= 2026-10-27)."""
    from keras.src.backend.torch import trainer

    cls = getattr(trainer, "Trainer", None) or trainer.TorchTrainer
    return "_use_torch_compile" in vars(cls)


def clean_env(env: Mapping[str, str | None] | None = None, *, src: bool = True) -> dict:
    """``os.environ`` without our variables, KERAS_BACKEND=torch, strict mode
    (``KERAS_DTENSOR_FIX_STRICT=1``: a patch that cannot apply raises), then
    ``env``.

    ``None`` values remove a variable. With ``src`` the checkout's ``src`` is
    first on ``PYTHONPATH``.
    """
    full = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KERAS_DTENSOR_FIX") and k != "PYTHONPATH"
    }
    full["KERAS_BACKEND"] = "torch"
    full["KERAS_DTENSOR_FIX_STRICT"] = "1"
    if src:
        full["PYTHONPATH"] = str(SRC)
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    return full


def leave(code: int) -> NoReturn:
    """End a rank script's process with ``code``, skipping the interpreter's teardown.

    A gloo worker thread releases a finished collective's tensors after the
    caller's ``wait()`` returns, and releasing a tensor that has a Python object
    takes the GIL. When the main thread is already finalizing the interpreter,
    that thread exits inside a destructor and the process aborts ("terminate
    called without an active exception", SIGABRT) after all its work passed;
    torch's own fix (pytorch/pytorch#179291) was abandoned. A rank script that
    ends right after a collective hit it about one run in four on 2 cores.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def last_json(proc: subprocess.CompletedProcess) -> object:
    """The JSON document on the last line of a process's stdout."""
    assert proc.returncode == 0, proc.stderr + proc.stdout
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_ranks(
    script: os.PathLike | str,
    *argv: str,
    env: Mapping[str, str | None] | None = None,
    nproc: int = 2,
    timeout: float = 300,
    launcher: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` CPU ranks with ``torch.distributed.run``.

    The environment is :func:`clean_env` (torch backend, the checkout's
    ``src``) with one OpenMP thread per rank.
    """
    full = clean_env({"OMP_NUM_THREADS": "1", **(env or {})})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(key, None)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        *launcher,
        str(script),
        *argv,
    ]
    what = f"{Path(script).name} {' '.join(argv)} x{nproc} {dict(env or {})}"
    return timed_run(
        command, what, env=full, capture_output=True, text=True, timeout=timeout
    )


def run_agents(
    script: os.PathLike | str,
    *argv: str,
    env: Mapping[str, str | None] | None = None,
    launcher: tuple[str, ...] = (),
    timeout: float = 300,
    nnodes: str = "2",
    each: tuple[Mapping[str, str], Mapping[str, str]] = ({}, {}),
    stagger: float = 0.0,
) -> list[tuple[int, str]]:
    """Run ``script`` under two torchrun agents (``--nnodes=2``, c10d
    rendezvous on a free local port, one process each), as on two machines.

    ``each`` adds each agent's own environment; ``stagger`` seconds pass
    between the two starts (the first hosts the rendezvous store). Returns
    each agent's exit code and output (stdout and stderr).
    """
    import socket

    full = clean_env({"OMP_NUM_THREADS": "1", **(env or {})})
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        full.pop(key, None)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc_per_node=1",
        "--rdzv_backend=c10d",
        f"--rdzv_endpoint=127.0.0.1:{port}",
        *launcher,
        str(script),
        *argv,
    ]
    start = time.perf_counter()
    agents = []
    for own in each:
        if agents and stagger:
            time.sleep(stagger)
        agents.append(
            subprocess.Popen(
                command,
                env={**full, **own},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        outputs = [agent.communicate(timeout=timeout)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
        what = f"{Path(script).name} {' '.join(argv)} 2 agents {dict(env or {})}"
        LAUNCHES.append((time.perf_counter() - start, what))
    return [(a.returncode, o) for a, o in zip(agents, outputs, strict=True)]


# A fake "data" family that wraps distribute_data_input with a pass-through.
FAKE_DATA_FAMILY = """
from keras_dtensor_fix.engine.contract import Patch
FAMILY = "data"
MODULES = ("keras.src.backend.torch.distribution_lib",)
def keep(wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)
def patches(module):
    return [Patch(module.__name__, "distribute_data_input", keep,
                  also_in=("keras.src.backend.torch.trainer",))]
"""


#: A layer with sublayers (a block where a model holds two), as the source a
#: test script pastes in (``{BLOCK}``).
BLOCK = """
class Block(layers.Layer):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.inner = layers.Dense(4)
        self.outer = layers.Dense(4)
    def call(self, x):
        return self.outer(self.inner(x))
"""
