"""Launch the training scenarios on 2 CPU ranks (gloo) and on one process.

Each group of ``scenarios.py`` runs once per pytest session and per
environment; the tests compare its results case by case.
"""

from __future__ import annotations

import concurrent.futures
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
    return launch_groups([group], out, world=world, env=env)[group]


def launch_groups(
    groups: list[str], out: Path, *, world: int, env: dict[str, str] | None = None
) -> dict[str, list[dict]]:
    """Run ``groups`` in one launch of ``world`` processes: each group's
    result dicts, one per rank."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    full_env.update({"KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"})
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), full_env.get("PYTHONPATH")) if p
    )
    if not SLOW[0]:
        # Inductor's C++ vector code (the probe of the CPU's instruction set
        # and vectorized kernels) is most of a cold inductor compile on 2
        # cores, and nothing the plugin makes decides it: the default run
        # compiles scalar C++ (users on GPUs get Triton code either way); the
        # slow tier keeps the vector code. Every launch of a run alike, so a
        # warm launch finds the cold one's entries.
        full_env.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    full_env.update(env or {})
    script = [str(HERE / "scenarios.py"), ",".join(groups), str(out)]
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
        f"scenarios {','.join(groups)} x{world} {env or {}}",
        env=full_env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT * len(groups),
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(command)} exited {proc.returncode}\n{proc.stdout[-4000:]}\n"
            f"{proc.stderr[-8000:]}"
        )
    results = {}
    for group in groups:
        results[group] = []
        for rank in range(world):
            with open(out / f"{group}.rank{rank}.json") as handle:
                results[group].append(json.load(handle)["cases"])
    return results


#: The scenario groups that the session's selected tests compare, case by
#: case (filled once collection ends). Each is launched once on 2 processes
#: and once on one, with no extra environment: together, in one launch of
#: each (every launch pays for starting Python, torch, Keras and keras-hub).
BATCH: list[str] = []
#: The groups whose upstream run (``KERAS_DTENSOR_FIX=0``) tests read: those
#: of BATCH go together in one upstream launch too.
UPSTREAM = (
    "blocks",
    "dropin",
    "dropin_compiled",
    "hub",
    "hub_compiled",
    "layouts",
    "planned",
    "moe_compiled",
    "generate_compiled",
)
PLAIN, OFF = (), (("KERAS_DTENSOR_FIX", "0"),)
#: Groups a test launches again alone, on the batch's compile cache
#: (test_moe_compiled_cold_then_warm): they run first in the batch, so both
#: launches make the same process groups before them, as two launches of one
#: script do (a compiled graph names its groups, and so does its cache key).
REPEATED = ("moe_compiled",)
#: Whether the session selected a test marked ``slow``: then every launch
#: runs the cases registered ``slow=True`` too (``SCENARIO_SLOW=1``).
SLOW: list[bool] = [False]


def pytest_collection_finish(session) -> None:
    from scenarios import CASES

    wanted = set()
    SLOW[0] = any(item.get_closest_marker("slow") for item in session.items)
    for item in session.items:
        name = getattr(getattr(item, "callspec", None), "params", {}).get("name")
        if name not in CASES or any(
            mark.args and mark.args[0] is True for mark in item.iter_markers("skipif")
        ):
            continue
        spec = CASES[name]
        if spec["mesh"][0] * spec["mesh"][1] == 2 and spec["group"] != "harness":
            wanted.add(spec["group"])
    order = dict.fromkeys((*REPEATED, *(spec["group"] for spec in CASES.values())))
    BATCH[:] = [group for group in order if group in wanted]


class Runs:
    """Cached scenario runs for one pytest session.

    The session's 2-process plugin launch compiles into :attr:`compile_cache`,
    a directory of its own that it finds empty (cold, as on a fresh machine):
    ``test_moe_compiled_cold_then_warm`` launches again on it, warm.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.compile_cache = str(root / "compile-cache")
        self.cache: dict[tuple, list[dict]] = {}
        #: Launches running beside another, by the key of each group they run.
        self.pending: dict[tuple, concurrent.futures.Future] = {}
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)

    @staticmethod
    def ran(name: str) -> bool:
        """Whether the launches run case ``name`` (a slow one only when the
        session selected a slow test)."""
        from scenarios import CASES

        return SLOW[0] or not CASES[name].get("slow")

    def get(self, group: str, *, world: int, **env: str) -> list[dict]:
        key = (group, world, tuple(sorted(env.items())))
        if key not in self.cache and key in self.pending:
            self.cache.update(self.pending[key].result())
        if key not in self.cache:
            if world == 2 and key[2] == PLAIN:
                # The one-process reference keeps one core busy: it runs
                # beside the 2-process launch instead of after it.
                self._start((group, 1, PLAIN), background=True)
            self._start(key, background=False)
        return self.cache[key]

    def _start(self, key: tuple, *, background: bool) -> None:
        """Launch ``key``'s group with the groups of the batch it belongs to."""
        group, world, env = key
        together = {PLAIN: BATCH, OFF: [g for g in BATCH if g in UPSTREAM]}
        batch = together.get(env, []) if world <= 2 else []
        groups = [group]
        if group in batch:
            known = self.cache.keys() | self.pending.keys()
            groups = [g for g in batch if (g, world, env) not in known]
        if not groups:
            return
        launch_env = dict(env)
        if SLOW[0]:
            launch_env["SCENARIO_SLOW"] = "1"
        if world == 2 and env == PLAIN:
            launch_env["TORCHINDUCTOR_CACHE_DIR"] = self.compile_cache
        out = self.root / f"{group}-{world}-{len(self.cache) + len(self.pending)}"

        def run() -> dict[tuple, list[dict]]:
            found = launch_groups(groups, out, world=world, env=launch_env)
            return {(one, world, env): results for one, results in found.items()}

        if background:
            future = self.pool.submit(run)
            for one in groups:
                self.pending[(one, world, env)] = future
        else:
            self.cache.update(run())


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("scenarios"))
