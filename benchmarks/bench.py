"""ModelParallel step time: upstream Keras vs the plugin vs plain PyTorch TP.

One invocation runs, on the same machine, for each model (an MLP 64-1024-8 and
a small transformer block, Adam, batch 32):

  (a) upstream   Keras ModelParallel as shipped (plugin off, promotion mode on)
  (b) eager      the plugin, eager
  (c) compiled   the plugin, jit_compile=True (torch.compile)
  (d) torch-tp   plain PyTorch tensor parallel (Colwise/Rowwise, Adam foreach)
  (e) single     Keras on one process, plugin on; (f) single-off: plugin off;
      single-ab: both in one process, alternating blocks (activate/deactivate)
  tp-ab          (b) and (d) in the same two processes, alternating blocks

and prints median ms/step (over every timed step of every round), the ratios
to (a) and (d), the same ratios paired by round (the median over rounds of
this round's ratio: steadier on a noisy machine), collectives per step
(counted with torch's profiler) and, for (c), dynamo graphs and graph breaks.

    python benchmarks/bench.py [--steps 30] [--rounds 3] [--models mlp,transformer]
    nox -s bench
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NoReturn

from bench_steps import (
    BATCH,
    _alternate,
    _init_distributed,
    _keras_step,
    _time,
    _torch_tp_step,
    collectives,
    extra_calls,
)

CONFIGS = (
    "upstream",
    "eager",
    "compiled",
    "torch-tp",
    "single",
    "single-off",
    "single-ab",
    "tp-ab",
)


# ---------------------------------------------------------------- workers


def _nothing() -> None:
    pass


def _pin() -> None:
    """One core per rank (where the OS allows it): less jitter between runs."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cores) >= int(os.environ.get("WORLD_SIZE", "1")) > 0:
        rank = int(os.environ.get("LOCAL_RANK", "0"))
        os.sched_setaffinity(0, {cores[rank % len(cores)]})


def worker(config: str, model_name: str, out: Path, warmup: int, steps: int) -> None:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    _pin()
    import warnings

    import torch

    backend = _init_distributed()
    if config == "torch-tp":
        step = _torch_tp_step(model_name)
    else:
        step = _keras_step(model_name, config)
    times_b = pairs = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if config == "single-ab":
            import keras_dtensor_fix

            sides = [(keras_dtensor_fix.activate, step)]
            sides.append((keras_dtensor_fix.deactivate, step))
            times, times_b, pairs = _alternate(sides, warmup, steps)
            keras_dtensor_fix.activate()
        elif config == "tp-ab":
            sides = [(_nothing, step), (_nothing, _torch_tp_step(model_name))]
            times, times_b, pairs = _alternate(sides, warmup, steps)
        else:
            times = _time(step, warmup, steps)
    counters = torch._dynamo.utils.counters
    graphs = counters["stats"].get("unique_graphs", 0)
    # Upstream's refusal, the plugin's (an old torch, say), or nothing compiled.
    refused = ("Running without `torch.compile`", "jit_compile=True is not used")
    fallback = config == "compiled" and (
        graphs == 0 or any(r in str(w.message) for w in caught for r in refused)
    )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_step = collectives(step) if world > 1 else 0.0
    report = {
        "ms": statistics.median(times),
        "times": times,
        "collectives": per_step,
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()),
        "fallback": fallback,
        "backend": backend,
    }
    if times_b:
        report.update(ms_b=statistics.median(times_b), times_b=times_b, pairs=pairs)
    if config == "single-ab":
        report["calls"], report["extra_calls"] = extra_calls(step)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(report))
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def leave() -> NoReturn:
    """End a worker with status 0 once its report is written, skipping teardown.

    A gloo thread still releasing the last collective's tensors when Python
    finalizes aborts the process (SIGABRT) after the work is done.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---------------------------------------------------------------- driver


def run_config(config: str, model: str, args) -> dict:
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    env["BENCH_DEVICE"] = args.device
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # Keras and the reference on the CPU
    env["KERAS_DTENSOR_FIX"] = "0" if config in ("upstream", "single-off") else "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out.json")
        script = [
            __file__,
            "--worker",
            config,
            "--models",
            model,
            "--out",
            str(out),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
        ]
        if config.startswith("single"):
            command = [sys.executable, *script]
        else:
            command = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                *script,
            ]
        proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.exists():
            output = proc.stdout + proc.stderr
            if args.errors:
                with args.errors.open("a") as log:
                    log.write(f"==== {model} {config}: exit {proc.returncode}\n")
                    log.write(output + "\n")
            return {"error": f"exit {proc.returncode}: {_reason(output)}"}
        return json.loads(out.read_text())


def _reason(output: str) -> str:
    """The last exception line of a failed run's output (else its last line)."""
    lines = [re.sub(r"^\[rank\d+\]:", "", line).strip() for line in output.splitlines()]
    lines = [line for line in lines if line]
    for line in reversed(lines):
        head = line.split(":", 1)[0].split(".")[-1]
        if head.endswith(("Error", "Exception")) and " " not in head:
            return line
    return lines[-1] if lines else "no output"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of every configuration"
    )
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda where torch sees a GPU",
    )
    parser.add_argument(
        "--errors", type=Path, help="append the whole output of failed runs here"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.models, args.out, args.warmup, args.steps)
        leave()

    import platform

    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no GPU (torch.cuda.is_available())")
    where = "CPU, gloo"
    if args.device == "cuda":
        count = torch.cuda.device_count()
        shared = "nccl" if count >= 2 else "gloo, both ranks on one GPU"
        where = f"{count} x {torch.cuda.get_device_name(0)}, {shared}"
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores; 2 ranks, {where}; "
        f"torch {torch.__version__}; batch {BATCH}"
    )
    results: dict[str, dict[str, dict]] = {}
    for model in args.models.split(","):
        results[model] = {}
        # Rounds interleave the configurations, so that a slow spell of a
        # shared machine spreads over all of them; the median is over every
        # timed step of every round.
        for round_ in range(args.rounds):
            for config in args.configs.split(","):
                row = run_config(config, model, args)
                print(
                    f"  {model:12s} {config:10s} round {round_ + 1}: {_brief(row)}",
                    flush=True,
                )
                results[model][config] = _merge(results[model].get(config), row)
                if args.json:  # after every run: a cut-short run keeps its figures
                    args.json.write_text(json.dumps(results, indent=1))
    print()
    for model, rows in results.items():
        _table(model, rows)
    return 0


def _merge(previous: dict | None, row: dict) -> dict:
    """``row`` with the step times of earlier rounds; an error sticks."""
    if "error" not in row:
        row = {**row, "rounds": [row["ms"]]}
    if previous is None or "error" in row:
        return row
    if "error" in previous:
        return previous
    times = previous["times"] + row["times"]
    rounds = previous["rounds"] + row["rounds"]
    merged = {**row, "times": times, "ms": statistics.median(times), "rounds": rounds}
    if "times_b" in row:  # the A/B configurations' side b pools the same way
        b = previous["times_b"] + row["times_b"]
        pairs = previous["pairs"] + row["pairs"]
        merged.update(times_b=b, ms_b=statistics.median(b), pairs=pairs)
    return merged


def _paired(row: dict, base: dict | None) -> float | None:
    """Median over rounds of ``row``'s round median over ``base``'s, same round.

    Configurations of one round run back to back, so a slow spell of a shared
    machine weighs on both sides of each ratio.
    """
    if not base or "error" in base or "rounds" not in row:
        return None
    pairs = zip(row["rounds"], base["rounds"], strict=False)
    return statistics.median(a / b for a, b in pairs)


def _pairs_note(pairs: list[float], ratio: bool = False) -> str:
    """The mean over neighbouring blocks (a change or a ratio), 95% interval."""
    mean = statistics.fmean(pairs)
    half = 1.96 * statistics.stdev(pairs) / math.sqrt(len(pairs)) if pairs[1:] else 0
    if ratio:
        low, high = math.exp(mean - half), math.exp(mean + half)
        return f"blocks {math.exp(mean):.2f}x [{low:.2f}, {high:.2f}]"
    return f"blocks {100 * mean:+.1f}% +-{100 * half:.1f}%;"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _brief(row: dict) -> str:
    if "error" in row:
        return "ERROR " + row["error"][:300]
    return f"{row['ms']:.2f} ms/step"


def _table(model: str, rows: dict) -> None:
    base = rows.get("upstream", {}).get("ms")
    ref = rows.get("torch-tp", {}).get("ms")
    print(f"{model}: median ms/step, ratios, collectives/step")
    print(
        f"  {'config':10s} {'ms/step':>8s} {'/upstream':>9s} {'/torch-tp':>9s} "
        f"{'paired /a':>9s} {'paired /d':>9s} {'coll/step':>9s}  notes"
    )
    for config, row in rows.items():
        if "error" in row:
            print(f"  {config:10s} ERROR")
            continue
        ms = row["ms"]
        r_a = _ratio(ms / base if base else None)
        r_d = _ratio(ms / ref if ref else None)
        notes = []
        if config == "compiled":
            notes.append(f"graphs={row['graphs']} breaks={row['breaks']}")
            if row["fallback"]:
                notes.append("FELL BACK TO EAGER")
        if config == "single-ab":
            change = 100 * (ms / row["ms_b"] - 1)
            notes.append(f"plugin off {row['ms_b']:.2f} ms: {change:+.1f}% on;")
            notes.append(_pairs_note(row["pairs"]))
            notes.append(f"Python calls +{row['extra_calls']} of {row['calls']}")
        if config == "tp-ab":
            ratio = ms / row["ms_b"]
            notes.append(f"torch-tp here {row['ms_b']:.2f} ms: {ratio:.2f}x;")
            notes.append(_pairs_note(row["pairs"], ratio=True))
        coll = f"{row['collectives']:.1f}" if not config.startswith("single") else "-"
        p_a = _ratio(_paired(row, rows.get("upstream")))
        p_d = _ratio(_paired(row, rows.get("torch-tp")))
        print(
            f"  {config:10s} {ms:8.2f} {r_a:>9s} {r_d:>9s} {p_a:>9s} {p_d:>9s} "
            f"{coll:>9s}  {' '.join(notes)}"
        )
    on, off = rows.get("single", {}).get("ms"), rows.get("single-off", {}).get("ms")
    if on and off:
        paired = _paired(rows["single"], rows["single-off"])
        by_round = ""
        if paired is not None:
            by_round = f", paired by round {100 * (paired - 1):+.1f}%"
        print(
            f"  non-distributed overhead of the plugin: {100 * (on / off - 1):+.1f}%"
            f"{by_round}"
        )
    print()


if __name__ == "__main__":
    sys.exit(main())
