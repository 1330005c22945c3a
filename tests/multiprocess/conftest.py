"""Launch the training scenarios on 2 CPU ranks (gloo) and on one process.

Each group of ``scenarios.py`` runs once per pytest session and per
environment; the tests compare its results case by case.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from support import timed_run

HERE = Path(__file__).resolve().parent
SRC = HERE.parents[1] / "src"
TIMEOUT = int(os.environ.get("SCENARIO_TIMEOUT", "900"))


def launch(
    group: str, out: Path, *, world: int, env: dict[str, str] | None = None
) -> list[dict]:
    """Run ``scenarios.py group`` on ``world`` processes; one result dict per rank."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    full_env.update({"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"})
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), full_env.get("PYTHONPATH")) if p
    )
    full_env.update(env or {})
    script = [str(HERE / "scenarios.py"), group, str(out)]
    if world > 1:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={world}",
            *script,
        ]
    else:
        command = [sys.executable, *script]
    proc = timed_run(
        command,
        f"scenarios {group} x{world} {env or {}}",
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    results = []
    for rank in range(world):
        with open(out / f"{group}.rank{rank}.json") as handle:
            results.append(json.load(handle)["cases"])
    return results


class Runs:
    """Cached scenario runs for one pytest session."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cache: dict[tuple, list[dict]] = {}

    def get(self, group: str, *, world: int, **env: str) -> list[dict]:
        key = (group, world, tuple(sorted(env.items())))
        if key not in self.cache:
            out = self.root / f"{group}-{world}-{len(self.cache)}"
            self.cache[key] = launch(group, out, world=world, env=env)
        return self.cache[key]


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("scenarios"))
