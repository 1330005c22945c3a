"""The README's first command: the 2-process demonstration passes."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import SRC


def test_demo_passes() -> None:
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), env.get("PYTHONPATH")) if p
    )
    proc = subprocess.run(
        [sys.executable, "-m", "keras_dtensor_fix", "demo"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout
    assert "dispatch modes active during training: none" in proc.stdout
