"""Sharded ``generate()`` against one process: the matrix of issue 34.

For each hidden size and prompt/new-token lengths, in this order (each a
fresh process, so the runs interleave and share the machine's state): one
process eager (no distribution), the plugin on 2 processes eager, the plugin
on 2 processes with ``jit_compile=True`` (compiled token step), one process
with ``jit_compile=True``, one process eager again, and two one-process eager
runs at once (``--twins``: what a process gets of this machine when another
runs beside it, as each of the 2 sharded processes does). Each run is
``generate_ops.py --timing-only`` (tiny random Gemma, 4 layers, greedy, Gemma's
own ``get_layout_map`` on (1, 2)), on an empty compile cache of its own.
Prints a Markdown table (ms/token, the ratio to the two one-process eager
runs, the first call) and whether every run generated the same tokens;
``--json`` keeps the records. Since 2026-11-28 the plugin compiles tokens only
under ModelParallel: the one-process ``jit_compile=True`` run generates as
keras-hub does on torch, eagerly (the dated results before then measured the
plugin's unsharded compiled step).

    python benchmarks/generate_matrix.py --json results/DATE-generate-matrix.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "generate_ops.py"
RUNS = (
    ("one process, eager", 1, False),
    ("plugin, 2 processes, eager", 2, False),
    ("plugin, 2 processes, compiled", 2, True),
    ("one process, compiled", 1, True),
    ("one process, eager, again", 1, False),
)
TWINS = ("two one-process runs at once, eager (each)", 0, False)


def command_for(world: int, compiled: bool, hidden: int, prompt: int, new: int):
    """The ``generate_ops.py`` command of one run (``world`` 0: one process)."""
    command = [sys.executable]
    if world > 1:
        command += ["-m", "torch.distributed.run", "--standalone"]
        command += [f"--nproc_per_node={world}"]
    command += [str(SCRIPT), "--timing-only", "--hidden", str(hidden)]
    command += ["--prompt", str(prompt), "--length", str(prompt + new)]
    if compiled:
        command.append("--compile")
    return command


def record_of(command: list[str], proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RECORD ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"{' '.join(command)}\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
        )
    return json.loads(lines[-1][len("RECORD ") :])


def run(world: int, compiled: bool, hidden: int, prompt: int, new: int) -> dict:
    """One ``generate_ops.py`` run's record; ``world`` 0: two one-process
    runs at once, the slower one's record."""
    command = command_for(world, compiled, hidden, prompt, new)
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
        env["TORCHINDUCTOR_CACHE_DIR"] = cache
        if world:
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
            return record_of(command, proc)
        twins = [
            subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            for _ in range(2)
        ]
        records = []
        for twin in twins:
            out, err = twin.communicate()
            done = subprocess.CompletedProcess(
                command, twin.returncode, out.decode(), err.decode()
            )
            records.append(record_of(command, done))
    slower = max(records, key=lambda r: r["ms_per_token"])
    return {
        **slower,
        "world": 0,
        "twin_ms_per_token": [r["ms_per_token"] for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", default="256,1024")
    parser.add_argument("--lengths", default="16/48,128/128", help="prompt/new, ...")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--twins", action="store_true", help="two one-process eager runs at once too"
    )
    args = parser.parse_args()
    runs = RUNS + ((TWINS,) if args.twins else ())
    records = []
    print("| hidden | prompt/new | run | ms/token | x one process eager | first call |")
    print("| ---: | --- | --- | ---: | --- | ---: |")
    for hidden in (int(h) for h in args.hidden.split(",")):
        for lengths in args.lengths.split(","):
            prompt, new = (int(n) for n in lengths.split("/"))
            found = []
            for name, world, compiled in runs:
                record = run(world, compiled, hidden, prompt, new)
                record["run"] = name
                found.append(record)
                records.append(record)
            eager = [
                r["ms_per_token"]
                for r in found
                if r["world"] == 1 and not r["compiled"]
            ]
            same = all(
                r["tokens"] == found[0]["tokens"] and r["same_tokens"] for r in found
            )
            for r in found:
                ratios = "-".join(f"{r['ms_per_token'] / e:.2f}" for e in sorted(eager))
                ms, first = r["ms_per_token"], r["first_call_s"]
                print(
                    f"| {hidden} | {prompt}/{new} | {r['run']} | {ms:.1f} "
                    f"| {ratios}x | {first:.1f} s |"
                )
            print(f"<!-- hidden {hidden}, {prompt}/{new}: same tokens: {same} -->")
            sys.stdout.flush()
    if args.json:
        args.json.write_text(json.dumps(records, indent=1))


if __name__ == "__main__":
    main()
