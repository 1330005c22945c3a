"""ModelParallel ``model.fit()`` speed on the models users run (keras-hub).

Models, random weights, no download, fed ``{"token_ids", "padding_mask"}``:

  gpt     TokenAndPositionEmbedding + TransformerDecoder blocks (keras_hub.layers)
          + a Dense head, with a Megatron-style LayoutMap written here
  gemma   GemmaCausalLM(preprocessor=None), GemmaBackbone.get_layout_map(mesh)
  llama   LlamaCausalLM(preprocessor=None), LlamaBackbone.get_layout_map(mesh)

each at several widths (``--sizes``; ``--sweep`` adds GPT widths for the
plot), 4 layers, sequence 128, head size 64, FFN 4x, vocabulary 2048, Adam,
the global batch (``--batch``) fed whole to every rank of a (1, N) mesh and
split by rows over the batch axis of a (2, 2) mesh. Configurations, each its
own processes, interleaved over ``--rounds``:

  upstream    Keras ModelParallel as shipped (KERAS_DTENSOR_FIX=0), 2 ranks
  eager       the plugin, 2 ranks
  compiled    the plugin, jit_compile=True, 2 ranks (models with keras-hub
              layers run eagerly, with a warning: reported as ran-eager)
  single      one process, no distribution, plugin on; single-off: plugin off
  eager-noleaves  eager with the ``leaves`` family off (not in the default
              set): what layers on local tensors change, in the same run;
              eager-ab: 2 ranks switching the leaves family's local path on
              and off in alternating blocks of steps (as single-ab does)
  eager4, upstream4   4 ranks on a (2, 2) mesh (``--four``; slow on 2 cores)
  planned, planned-compiled   eager and compiled on 2 ranks with the layout
              ``keras_dtensor_fix.auto_layout_map(build, mesh)`` plans
              instead of the case's own map (``--planned``); the report lists
              each weight whose resolved layout differs between the two maps

Every process uses one thread (torch.set_num_threads(1)), so a 2-rank step
compares with one process's one-thread step on the same global batch. Step
times come from a Callback (time between consecutive ``on_train_batch_end``
of one ``fit()``), the first ``--warmup`` steps (build, compile) left out.
Prints ms/step, tokens/s, ratios paired by round with a bootstrap interval,
collectives and DTensor-dispatched ops per step (c10d and ``PythonSubclass``
events in torch's profiler, after the timed steps), dynamo graphs and breaks,
peak RSS per rank (VmHWM, reset per case); writes a JSON, a log and, with
``--plot``, ms/step against width (PNG).

    python benchmarks/hub.py [--rounds 2] [--four] [--plot results/x.png]
    nox -s bench -- --models hub [hub.py arguments]
    python benchmarks/hub.py --profile gpt:512   # phases + plugin hot spots
    python benchmarks/hub.py --profile gpt:512 --kinds  # eager vs compiled, by kind
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import bench  # noqa: E402  benchmarks/bench.py: _pin(), _reason(), leave()
from hub_profile import kinds_worker, profile_worker  # noqa: E402
from hub_worker import (  # noqa: E402
    AB_CONFIG,
    CONFIGS,
    FOUR_CONFIGS,
    LAYERS,
    PLANNED_CONFIGS,
    SEQ,
    TITLES,
    VOCAB,
    worker,
)

# ---------------------------------------------------------------- driver


def run_config(config: str, cases: list[str], args) -> dict:
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["KERAS_DTENSOR_FIX_COMPILE"] = "step"  # compiled: the whole step
    off = config.startswith(("upstream", "single-off"))
    env["KERAS_DTENSOR_FIX"] = "0" if off else "1"
    if config == "eager-noleaves":
        env["KERAS_DTENSOR_FIX_DISABLE"] = "leaves"
    ranks = 4 if config.endswith("4") else 1 if config.startswith("single") else 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out.json")
        script = [__file__, "--worker", config, "--cases", ",".join(cases)]
        script += ["--out", str(out), *_shape_args(args)]
        command = [sys.executable, *script]
        if ranks > 1:
            command[1:1] = [
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
            ]
        if args.lock:  # a shared machine: one process group at a time
            command = ["flock", str(args.lock), *command]
        try:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as err:
            output, code = f"{err.stdout}{err.stderr}\nTimeout", "timeout"
        results = json.loads(out.read_text()) if out.exists() else {}
    if code != 0 and args.errors:
        with args.errors.open("a") as log:
            log.write(f"==== {config} {cases}: exit {code}\n{output}\n")
    for case in cases:
        results.setdefault(case, {"error": f"exit {code}: {bench._reason(output)}"})
    return results


def _shape_args(args) -> list[str]:
    return [
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--batch={args.batch}",
        f"--seq={args.seq}",
        f"--layers={args.layers}",
    ]


def _bootstrap(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    """95% interval of median(a) / median(b), resampling each side's steps."""
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a)))
        / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(n)
    )
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


PAIRS = (  # (numerator, denominator, label): the goals
    ("eager", "upstream", "eager/upstream (goal <= 0.3)"),
    ("eager", "single", "2 ranks/1 process (goal <= 0.65)"),
    ("compiled", "eager", "compiled/eager (goal <= 0.6)"),
    ("eager", "eager-noleaves", "eager: leaves family on/off"),
    ("eager-noleaves", "single", "2 ranks (leaves off)/1 process"),
    ("single", "single-off", "plugin on/off, 1 process (goal <= 1.01)"),
    ("eager4", "upstream4", "4 ranks: eager/upstream"),
    ("eager4", "single", "4 ranks/1 process"),
    ("planned", "eager", "planned/own map, eager (goal <= 1.05)"),
    ("planned-compiled", "compiled", "planned/own map, compiled (goal <= 1.05)"),
    ("planned", "upstream", "planned eager/upstream"),
    ("planned", "single", "planned eager 2 ranks/1 process"),
    ("planned-compiled", "single", "planned compiled 2 ranks/1 process"),
)


def report(results: dict, args, log) -> None:
    def say(text: str = "") -> None:
        print(text, flush=True)
        log.write(text + "\n")

    for case, configs in results.items():
        kind, hidden = case.split(":")
        tokens = args.batch * args.seq
        say(f"{kind} hidden {hidden}: batch {args.batch} x seq {args.seq}")
        say(
            f"  {'config':16s} {'ms/step':>8s} {'tok/s':>7s} {'rounds':>22s} "
            f"{'coll':>5s} {'dt-ops':>6s} {'graphs':>6s} {'breaks':>6s} "
            f"{'peak MB/rank':>14s}  notes"
        )
        for config, row in configs.items():
            if "error" in row:
                error = re.sub(r"\x1b\[[0-9;]*m|\s+", " ", row["error"])
                say(f"  {config:16s} ERROR {error[:240]}")
                continue
            rounds = ", ".join(f"{r:.0f}" for r in row["rounds"])
            peaks = row.get("peak_mb_ranks") or [row["peak_mb"]]
            peak = "/".join(f"{p:.0f}" for p in peaks if p is not None)
            note = "compiled requested, ran eager" if row.get("ran_eager") else ""
            if "pairs" in row:
                note = (
                    f"{'leaves' if config == 'eager-ab' else 'plugin'} off here "
                    f"{row['ms_off']:.1f} ms: on/off "
                    + bench._pairs_note(row["pairs"], ratio=True)
                )
            coll = "-" if config.startswith("single") else f"{row['collectives']:.0f}"
            ops = (
                "-"
                if config.startswith("single")
                else f"{row.get('dtensor_ops', 0):.0f}"
            )
            say(
                f"  {config:16s} {row['ms']:8.1f} {1e3 * tokens / row['ms']:7.0f} "
                f"{rounds:>22s} {coll:>5s} {ops:>6s} {row['graphs']:6d} "
                f"{row['breaks']:6d} {peak:>14s}  {note}"
            )
        _say_layouts(configs, say)
        for num, den, label in PAIRS:
            a, b = configs.get(num), configs.get(den)
            if not a or not b or "error" in a or "error" in b:
                continue
            per_round = [x / y for x, y in zip(a["rounds"], b["rounds"], strict=False)]
            low, high = _bootstrap(a["times"], b["times"])
            say(
                f"  {label:42s} {a['ms'] / b['ms']:5.2f} "
                f"[{low:.2f}, {high:.2f}]; by round "
                + ", ".join(f"{r:.2f}" for r in per_round)
            )
        say()


def _say_layouts(configs: dict, say) -> None:
    """The planned map against the case's own, weight by weight."""
    row = next((r for r in configs.values() if "layout_diff" in r), None)
    if row is None:
        return
    diff, total = row["layout_diff"], row["layout_weights"]
    say(f"  plan: {row['plan']}")
    say(
        f"  planned map against own map: {total - len(diff)} of {total} weights "
        + ("laid out the same (equal steps by construction)" if not diff else "same")
    )
    for line in diff:
        say(f"    differs: {line}")


def plot(results: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "upstream": "upstream Keras, 2 ranks",
        "eager": "plugin eager, 2 ranks",
        "compiled": "plugin jit_compile=True, 2 ranks",
        "single": "one process, one thread",
    }
    models = sorted(
        {c.split(":")[0] for c in results},
        key=lambda m: -sum(c.startswith(m + ":") for c in results),
    )
    models = [m for m in models if sum(c.startswith(m + ":") for c in results) >= 3]
    models = models or sorted({c.split(":")[0] for c in results})
    fig, axes = plt.subplots(
        1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False
    )
    for ax, model in zip(axes[0], models, strict=True):
        for config, label in labels.items():
            points = sorted(
                (int(case.split(":")[1]), rows[config]["ms"])
                for case, rows in results.items()
                if case.startswith(model + ":")
                and "error" not in rows.get(config, {"error": 1})
            )
            eager = all(
                rows.get(config, {}).get("ran_eager", True)
                for case, rows in results.items()
                if case.startswith(model + ":")
            )
            if config == "compiled" and eager:
                label = labels[config] + " (ran eager)"
            if points:
                style = "--" if config == "compiled" else "-"
                ax.plot(*zip(*points, strict=True), style, marker="o", label=label)
        failed = []
        for config in labels:
            widths = [
                case.split(":")[1]
                for case, rows in results.items()
                if case.startswith(model + ":") and "error" in rows.get(config, {})
            ]
            if widths:
                failed.append(f"{config} fails at {', '.join(widths)}")
        title = TITLES.get(model, model)
        if failed:
            title += f"\n({'; '.join(failed)})"
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"hidden size ({args.layers} layers, FFN 4x)")
        ax.set_ylabel("ms per fit() step (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"batch {args.batch} x seq {args.seq}, CPU, gloo, 1 thread per rank",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,gemma,llama")
    parser.add_argument("--sizes", default="256,1024", help="hidden sizes")
    parser.add_argument("--sweep", default="", help="more widths, e.g. 128,512")
    parser.add_argument("--sweep-models", default="gpt,gemma", help="for --sweep")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--four", action="store_true", help="also 4 ranks, (2, 2)")
    parser.add_argument("--four-cases", default="", help="cases for --four")
    parser.add_argument(
        "--planned", action="store_true", help="also the auto_layout_map configs"
    )
    parser.add_argument(
        "--ab", action="store_true", help="plugin on/off A/B in one process"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="global batch")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--timeout", type=int, default=1800, help="s per process")
    parser.add_argument("--errors", type=Path, help="full output of failed runs")
    parser.add_argument("--lock", type=Path, help="run each config under flock")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--log", type=Path, help="write the report here too")
    parser.add_argument("--plot", type=Path, help="ms/step against width (PNG)")
    parser.add_argument("--from-json", type=Path, help="report and plot a --json")
    parser.add_argument("--profile", help="CASE (e.g. gpt:512): phases, hot spots")
    parser.add_argument("--ranks", type=int, default=2, help="for --profile")
    parser.add_argument(
        "--kinds",
        action="store_true",
        help="with --profile: eager and compiled step time by kind of work",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "profile":
        profile_worker(args.cases, args)
        bench.leave()
    if args.worker == "kinds":
        kinds_worker(args.cases, args)
        bench.leave()
    if args.worker:
        worker(args.worker, args.cases.split(","), args.out, args)
        bench.leave()
    if args.profile:
        env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
        env["KERAS_DTENSOR_FIX_COMPILE"] = "step"  # compiled: the whole step
        which = "kinds" if args.kinds else "profile"
        script = [__file__, f"--worker={which}", f"--cases={args.profile}"]
        command = [sys.executable, *script, *_shape_args(args)]
        if args.ranks > 1:
            command[1:1] = ["-m", "torch.distributed.run", "--standalone"]
            command.insert(4, f"--nproc_per_node={args.ranks}")
        return subprocess.run(command, env=env).returncode

    import platform

    import keras
    import torch

    cases = [f"{m}:{s}" for m in args.models.split(",") for s in args.sizes.split(",")]
    for model in args.sweep_models.split(","):
        cases += [f"{model}:{s}" for s in args.sweep.split(",") if s]
    cases = list(dict.fromkeys(cases))
    cases.sort(key=lambda c: (c.split(":")[0], int(c.split(":")[1])))
    configs = [c for c in args.configs.split(",") if c]
    if args.four:
        configs += FOUR_CONFIGS
    if args.planned:
        configs += PLANNED_CONFIGS
    four_cases = args.four_cases.split(",") if args.four_cases else cases
    ab_cases = [c for c in cases if int(c.split(":")[1]) <= 256]
    if args.ab:
        configs.append(AB_CONFIG)
    log = (args.log or Path(os.devnull)).open("a")
    head = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
        f"{os.cpu_count()} cores; torch {torch.__version__}, keras {keras.version()}; "
        f"gloo, 1 thread per rank; {args.layers} layers, vocab {VOCAB}, "
        f"batch {args.batch}, seq {args.seq}; {args.warmup} warm-up + {args.steps} "
        f"timed steps, {args.rounds} rounds"
    )
    if args.from_json:
        head = f"report of {args.from_json} (steps {args.steps}, warm-up {args.warmup})"
    print(head, flush=True)
    log.write(head + "\n")
    results: dict[str, dict[str, dict]] = {c: {} for c in cases}
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        args.rounds = 0
    for round_ in range(args.rounds):
        for config in configs:
            run = four_cases if config in FOUR_CONFIGS else cases
            run = ab_cases if config == AB_CONFIG else run
            if not run:
                continue
            start = time.time()
            rows = run_config(config, run, args)
            took, load = time.time() - start, os.getloadavg()[0]
            line = f"round {round_ + 1} {config:16s} ({took:.0f} s, load {load:.1f}):"
            for case, row in rows.items():
                line += f" {case} " + (
                    "ERROR" if "error" in row else f"{row['ms']:.0f}"
                )
                results[case][config] = _merge(results[case].get(config), row)
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    print()
    report(results, args, log)
    if args.plot:
        plot(results, args.plot, args)
    return 0


def _merge(previous: dict | None, row: dict) -> dict:
    if "error" not in row:
        row = {**row, "rounds": [row["ms"]]}
    if previous is None or "error" in row:
        return row if previous is None or "error" in previous else previous
    if "error" in previous:
        return row
    times = previous["times"] + row["times"]
    merged = {
        **row,
        "times": times,
        "ms": statistics.median(times),
        "rounds": previous["rounds"] + row["rounds"],
    }
    if "pairs" in row:  # single-ab: pool side b and the block pairs too
        merged["times_off"] = previous["times_off"] + row["times_off"]
        merged["ms_off"] = statistics.median(merged["times_off"])
        merged["pairs"] = previous["pairs"] + row["pairs"]
    return merged


if __name__ == "__main__":
    sys.exit(main())
