"""The README's first command: the demonstration runs and passes.

It trains the same 2-process ModelParallel script with the plugin off
(upstream Keras) and on (eager, then jit_compile=True), then on one process.
"""

from __future__ import annotations

import os
import re
import sys

from conftest import SRC
from support import timed_run


def test_demo_passes() -> None:
    # Without inductor's probe of the CPU's vector instructions (seconds per
    # process, torch's): scalar C++ code, as every launch of the default run
    # compiles (conftest.launch_groups). What the demo checks is the same.
    env = {**os.environ, "KERAS_BACKEND": "torch", "TORCHINDUCTOR_VEC_ISA_OK": "0"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), env.get("PYTHONPATH")) if p
    )
    proc = timed_run(
        [sys.executable, "-m", "keras_dtensor_fix", "demo"],
        "demo",
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    # Progress: each phase announced, each epoch reported as it ends.
    for phase in ("[1/3] plugin OFF", "[2/3] plugin ON", "[3/3] reference"):
        assert phase in out
    assert out.count("  epoch 5/5: ") == 4  # upstream, eager, jit, 1 process
    # A time per step for every run: upstream works on this build, slowly.
    for run in ("upstream Keras (plugin off), eager:", "plugin, eager:"):
        assert re.search(re.escape(run) + r"\s+[\d.]+ ms/step", out), run
    assert re.search(r"plugin, jit_compile=True:\s+[\d.]+ ms/step\n", out)
    assert "upstream with jit_compile=True: `jit_compile=True` is not supported" in out
    assert "dispatch modes active during training with the plugin: none" in out
    assert "DTensor (Replicate(), Shard(dim=1))" in out
    verdict = out.strip().splitlines()[-1]
    assert verdict.startswith("PASS: plugin eager "), verdict
    compiled = r"than upstream Keras .*; compiled [\d.]+x (faster|slower)"
    assert re.search(compiled, verdict), verdict
    assert "losses match one process to " in verdict
