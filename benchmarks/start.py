"""Start and step of eager, the whole step and blocks mode, by depth, in one run.

For each model (``--models``, from hub_worker.py: ``gpt`` and ``gemma``) and
depth (``--layers``, default 2, 8 and 16) on 2 ranks, mesh (1, 2), its own
layout, each round (``--rounds``) runs, in this order and each in its own
processes (``--configs`` picks a subset):

  eager   jit_compile=False
  cold    jit_compile=True, the whole step compiled
          (KERAS_DTENSOR_FIX_COMPILE=step), on an empty torch compile cache (a
          new TORCHINDUCTOR_CACHE_DIR, which holds inductor's, AOT autograd's
          and the FX graph caches)
  warm    the same again on the cache the cold run just filled: the same
          script launched again
  blocks-cold, blocks-warm   KERAS_DTENSOR_FIX_COMPILE=blocks (the step
          eager, each repeated block compiled once), on a cache of their own
  single-cold, single-warm (``--single``)   the whole step on one process
          with no distribution: plain Keras's own compiled start
  base-cold, base-warm (``--baseline-src DIR``)   blocks mode with the plugin
          imported from DIR (another checkout's ``src``): before and after a
          change, interleaved in one run

and prints each first epoch (build, compile, ``--steps`` steps), the later
epochs' (``--epochs``) median time a step (the steady state), the ratios to
eager's first epoch and to eager's and the whole step's (warm) step time,
paired by round, the start added per layer against the shallowest depth's, the
compile caches' misses of each warm launch,
and where a compiled start goes (dynamo's ``compile_times``, rank 0: tracing,
AOT autograd, inductor). ``--sources`` also splits dynamo's tracing by the
code it traced (rank 0): Keras, keras-hub, the plugin, torch, the rest,
each bytecode's time charged to the function it is in (a clock read around
each traced instruction; the time of an op dynamo runs on fake tensors goes
to the code that called it), and the graph's backend apart.

The step figures come from separate launches: on a shared machine they drift
more than in ``blocks_steps.py``, which times the modes in one launch.

    python benchmarks/start.py [--rounds 1] [--models gpt,gemma]
        [--layers 2,8,16] [--configs eager,warm,blocks-cold,blocks-warm]
        [--single] [--no-step] [--sources]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

HERE = Path(__file__).resolve().parent
CONFIGS = ("eager", "cold", "warm")
#: blocks mode, cold then warm (in the default run).
BLOCKS = ("blocks-cold", "blocks-warm")
#: ``--single``: the same model compiled on one process with no distribution
#: (plain Keras), cold then warm: what tracing costs without DTensor.
SINGLE = ("single-cold", "single-warm")
#: ``--baseline-src``: blocks mode with another checkout's plugin.
BASE = ("base-cold", "base-warm")


def source_of(filename: str) -> str:
    """The package a traced function's file belongs to (``--sources``)."""
    for marker, name in (
        ("keras_dtensor_fix", "plugin"),
        ("keras_hub", "keras-hub"),
        (f"{os.sep}keras{os.sep}", "keras"),
        (f"{os.sep}torch{os.sep}", "torch"),
    ):
        if marker in filename:
            return name
    return "other"


def trace_by_source() -> dict[str, float]:
    """Charge each instruction dynamo traces to its function's package.

    Returns the dict it fills: seconds by package, the instruction's own time
    (an inlined call's instructions count for the callee, not the caller).
    """
    from torch._dynamo import output_graph, symbolic_convert

    seconds: dict[str, float] = {}
    stack: list[list] = []  # [package, seconds spent in nested instructions]
    step = symbolic_convert.InstructionTranslatorBase.step
    clock = time.perf_counter

    def timed_step(self):
        stack.append([source_of(self.f_code.co_filename), 0.0])
        began = clock()
        try:
            return step(self)
        finally:
            spent = clock() - began
            source, nested = stack.pop()
            seconds[source] = seconds.get(source, 0.0) + spent - nested
            if stack:
                stack[-1][1] += spent

    def timed_compiler(self, *args, **kwargs):
        # The graph's backend (AOT autograd, inductor) runs inside the step
        # that ends the trace: its time is the backend's, not that code's.
        began = clock()
        try:
            return compile_graph(self, *args, **kwargs)
        finally:
            spent = clock() - began
            seconds["backend"] = seconds.get("backend", 0.0) + spent
            if stack:
                stack[-1][1] += spent

    compile_graph = output_graph.OutputGraph.call_user_compiler
    output_graph.OutputGraph.call_user_compiler = timed_compiler
    symbolic_convert.InstructionTranslatorBase.step = timed_step
    return seconds


def worker(args: argparse.Namespace) -> None:
    """One rank: build, fit two epochs, write the epoch times (rank 0)."""
    import keras
    import numpy as np
    import torch

    sys.path.insert(0, str(HERE))
    import hub_worker as hub

    torch.set_num_threads(1)
    if "WORLD_SIZE" in os.environ:
        keras.distribution.initialize()
        mesh = keras.distribution.DeviceMesh(
            (1, 2), ["batch", "model"], keras.distribution.list_devices()
        )
        distribution = keras.distribution.ModelParallel(
            layout_map=hub.layout_map(args.model, mesh), batch_dim_name="batch"
        )
        distribution.auto_shard_dataset = False  # each rank feeds the whole batch
        keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    model = hub.build(args.model, args.hidden, args.layers, args.seq)
    model.jit_compile = args.compiled

    class Epochs(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            # The first epoch counts from fit()'s call: the build is in it.
            times.append(time.perf_counter() - (begin if epoch == 0 else self.start))

    times: list[float] = []
    sources = trace_by_source() if args.sources and args.compiled else {}
    rng = np.random.default_rng(0)
    n = args.batch * args.steps
    ids = rng.integers(1, hub.VOCAB, size=(n, args.seq)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    begin = time.perf_counter()
    model.fit(
        x,
        np.roll(ids, -1, axis=1),
        batch_size=args.batch,
        epochs=args.epochs,
        shuffle=False,
        verbose=0,
        callbacks=[Epochs()],
    )
    phases = {}
    if args.compiled:
        from torch._dynamo.utils import compile_times

        headers, values = compile_times(repr="csv", aggregate=True)
        phases = {h: float(v) for h, v in zip(headers, values, strict=False)}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.out).write_text(
            json.dumps(
                {
                    "first": times[0],
                    "second": times[1],
                    "step": statistics.median(times[1:]) / args.steps,
                    "phases": phases,
                    "graphs": graphs,
                    "breaks": breaks,
                    # hits, misses and bypasses of the FX graph and AOT caches
                    "caches": {
                        k: v
                        for group in ("inductor", "aot_autograd")
                        for k, v in torch._dynamo.utils.counters[group].items()
                        if "cache" in k
                    },
                    "loss": model.history.history["loss"] if model.history else None,
                    "sources": {k: round(v, 2) for k, v in sources.items()},
                }
            )
        )


def launch(
    args: argparse.Namespace, model: str, layers: int, config: str, cache: str
) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    env["TORCHINDUCTOR_CACHE_DIR"] = cache
    # "step" is the whole step (blocks mode is the default for repeated blocks)
    blocks = config.startswith(("blocks", "base"))
    env["KERAS_DTENSOR_FIX_COMPILE"] = "blocks" if blocks else "step"
    if config.startswith("base"):
        env["PYTHONPATH"] = os.pathsep.join(
            [args.baseline_src, *filter(None, [env.get("PYTHONPATH")])]
        )
    ranks = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    command = [
        sys.executable,
        *([] if config.startswith("single") else ranks),
        __file__,
        "--worker",
        f"--model={model}",
        f"--out={out}",
        f"--hidden={args.hidden}",
        f"--layers={layers}",
        f"--seq={args.seq}",
        f"--batch={args.batch}",
        f"--steps={args.steps}",
        f"--epochs={args.epochs}",
    ] + (["--compiled"] if config != "eager" else [])
    command += ["--sources"] if args.sources else []
    began = time.perf_counter()
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        return {"error": proc.stderr[-2000:]}
    return {**json.loads(out.read_text()), "launch": time.perf_counter() - began}


def configs_of(args: argparse.Namespace) -> tuple[str, ...]:
    """The configurations a round runs, in their order."""
    chosen = args.configs.split(",")
    if args.no_step:
        chosen = [c for c in chosen if c not in ("cold", "warm")]
    chosen += list(SINGLE if args.single else ())
    chosen += list(BASE if args.baseline_src else ())
    unknown = set(chosen) - set(CONFIGS + BLOCKS + SINGLE + BASE)
    if unknown:
        raise SystemExit(f"unknown configurations: {sorted(unknown)}")
    return tuple(chosen)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compiled", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="gpt", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--models", default="gpt,gemma")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", default="2,8,16", help="depths, comma-separated")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3, help="2 or more")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS + BLOCKS), help="a round's runs, in order"
    )
    parser.add_argument(
        "--baseline-src", help="add " + str(BASE) + ": the plugin from this src"
    )
    parser.add_argument("--single", action="store_true", help="add " + str(SINGLE))
    parser.add_argument(
        "--no-step", action="store_true", help="leave out cold and warm (eager stays)"
    )
    parser.add_argument("--json", help="write every run here")
    parser.add_argument(
        "--sources", action="store_true", help="split dynamo's tracing by package"
    )
    args = parser.parse_args()
    if args.worker:
        args.layers = int(args.layers)
        worker(args)
        return
    import torch

    depths = [int(n) for n in args.layers.split(",")]
    configs = configs_of(args)
    print(
        f"torch {torch.__version__}, {os.cpu_count()} CPUs, hidden {args.hidden}, "
        f"layers {depths}, seq {args.seq}, batch {args.batch}, "
        f"{args.steps} steps an epoch, {args.epochs} epochs, 2 ranks, mesh (1, 2), "
        f"TORCHINDUCTOR_VEC_ISA_OK={os.environ.get('TORCHINDUCTOR_VEC_ISA_OK', '')}, "
        f"load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    runs: dict[str, dict[int, dict[str, list[dict]]]] = {}
    for round_ in range(args.rounds):
        for model in args.models.split(","):
            for layers in depths:
                caches = {
                    kind: tempfile.mkdtemp(prefix="start-cache-")
                    for kind in ("step", "single", "blocks", "base")
                }
                for config in configs:
                    kind = config.split("-")[0] if "-" in config else "step"
                    load = os.getloadavg()[0]
                    result = launch(args, model, layers, config, caches[kind])
                    result["load"] = load
                    by_config = runs.setdefault(model, {}).setdefault(layers, {})
                    by_config.setdefault(config, []).append(result)
                    shown = result.get("error", "")[-300:] or (
                        f"first {result['first']:.1f} s, step"
                        f" {1e3 * result['step']:.0f} ms, graphs {result['graphs']},"
                        f" breaks {result['breaks']}, caches {result['caches']},"
                        f" losses {result['loss']}, load {load:.1f}"
                    )
                    print(
                        f"round {round_ + 1} {model} {layers} {config}: {shown}",
                        flush=True,
                    )
    report(runs)
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


def paired(rows: list[dict], others: list[dict] | None, key: str) -> str:
    """The median ratio of ``rows``' ``key`` to ``others``', round by round."""
    ratios = [
        r[key] / o[key]
        for r, o in zip(rows, others or [], strict=False)
        if "error" not in r and "error" not in o
    ]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def median_of(rows: list[dict], key: str) -> float | None:
    ok = [r[key] for r in rows if "error" not in r]
    return statistics.median(ok) if ok else None


def report(runs: dict[str, dict[int, dict[str, list[dict]]]]) -> None:
    print(
        "\nmodel | layers | config | first epoch s | / eager first (paired) | step ms"
        " | / eager step | / whole step (warm) | start added a layer"
        " (of the shallowest's) | warm misses"
    )
    for model, depths in runs.items():
        shallowest = min(depths)
        for layers, configs in sorted(depths.items()):
            eager, whole = configs.get("eager"), configs.get("warm")
            order = CONFIGS + BLOCKS + SINGLE + BASE
            for config in [c for c in order if c in configs]:
                rows = configs[config]
                first = median_of(rows, "first")
                if first is None:
                    print(f"{model} | {layers} | {config} | failed")
                    continue
                base = median_of(depths[shallowest].get(config, []), "first")
                added = "-"
                if base and layers > shallowest:
                    per_layer = (first - base) / (layers - shallowest)
                    added = f"{per_layer:.1f} s ({100 * per_layer / base:.0f}%)"
                misses = "-"
                if config.endswith("warm"):
                    misses = sum(
                        v
                        for r in rows
                        if "error" not in r
                        for k, v in r["caches"].items()
                        if "miss" in k
                    )
                print(
                    f"{model} | {layers} | {config} | {first:.1f}"
                    f" | {paired(rows, eager, 'first')}"
                    f" | {1e3 * median_of(rows, 'step'):.0f}"
                    f" | {paired(rows, eager, 'step')} | {paired(rows, whole, 'step')}"
                    f" | {added} | {misses}"
                )
            for config in [c for c in configs if c != "eager"]:
                name = f"  {model} {layers} {config}"
                ok = [r for r in configs[config] if "error" not in r]
                if ok:
                    phases = ok[-1]["phases"]
                    top = sorted(phases.items(), key=lambda kv: -kv[1])[:6]
                    shown = ", ".join(f"{name} {secs:.1f}" for name, secs in top)
                    print(f"{name} compile phases (s, rank 0): {shown}")
                    traced = ok[-1].get("sources", {})
                    traced = sorted(traced.items(), key=lambda kv: -kv[1])
                    if traced:
                        shown = ", ".join(f"{name} {secs:.1f}" for name, secs in traced)
                        print(f"{name} traced code (s, rank 0): {shown}")


if __name__ == "__main__":
    main()
