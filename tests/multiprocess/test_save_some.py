"""``model.save`` on some processes only fails fast with an error that says why.

Under ModelParallel Keras gathers each sharded variable with a collective while
saving, so a save on process 0 alone (the data-parallel habit) waits for the
others. Upstream Keras (``KERAS_DTENSOR_FIX=0``, keras-nightly
3.16.0.dev2026102704) waits there until gloo's 30-minute timeout; with the
plugin, process 0 raises after the handshake's timeout, naming the missing
process and what to do, and a later save on every process works.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from support import ROOT, clean_env, run_ranks

SCRIPT = ROOT / "tests" / "ranks" / "save_some.py"


def test_save_on_one_process_is_an_error(tmp_path) -> None:
    proc = run_ranks(SCRIPT, str(tmp_path), timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    first = json.loads((tmp_path / "rank0.json").read_text())
    assert first["first"].startswith("MissingProcessesError"), first
    assert "process(es) [1]" in first["first"]
    assert "every process" in first["first"]
    assert first["seconds"] < 60
    for rank in (0, 1):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text())["second"]


@pytest.mark.slow
def test_upstream_waits(tmp_path) -> None:
    """Upstream: process 0 is still in its save 10 s after entering it (the
    plugin raises after its handshake's 5 s, set by the script)."""
    env = clean_env({"OMP_NUM_THREADS": "1", "KERAS_DTENSOR_FIX": "0"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc_per_node=2", str(SCRIPT), str(tmp_path)]
    proc = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        # Timed from the save, not the launch: a slow start cannot pass for
        # a wait.
        deadline = time.monotonic() + 240
        while not (tmp_path / "saving").exists():
            assert proc.poll() is None, "the launch ended before process 0 saved"
            assert time.monotonic() < deadline, "process 0 never began its save"
            time.sleep(0.2)
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=10)
    finally:
        # torchrun runs its ranks in sessions of their own and stops them
        # when it is terminated; a killed torchrun would leave them waiting.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert not (tmp_path / "rank0.json").exists()
