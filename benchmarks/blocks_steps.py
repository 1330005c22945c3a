"""Step time of blocks mode against eager and the whole step, interleaved.

Launch by launch (``start.py``) the step times of a shared machine drift by
more than the differences between the modes. Here one 2-rank launch per
depth (``--layers``) builds the GPT decoder of hub_worker.py once (hidden
``--hidden``, Megatron's layout on mesh (1, 2)), makes each configuration's
train function once, then runs ``--rounds`` rounds of one epoch each
(``--steps`` steps), the configurations taking turns:

  eager     jit_compile=False
  step      jit_compile=True, the whole step compiled
  blocks    KERAS_DTENSOR_FIX_COMPILE=blocks: the step eager, each repeated
            block its class's compiled graph, guards skipped once settled
  guarded   blocks with every call evaluating dynamo's guards (blocks mode
            before its calls skipped them)
  no-tail   blocks with the layers after the last block and the loss eager
            (blocks mode before they became one compiled region)
  no-opt    blocks with the optimizer's update eager (blocks mode before it
            became one compiled region)
  no-metrics  blocks with the compiled metrics updated eagerly after the
            step (blocks mode before the tail region updated them)

and prints each configuration's median step (rank 0, the steps of every
round) and its ratios to eager and to the whole step, paired by round.
``--phase evaluate`` or ``predict`` times that instead of ``fit()``, on a
model never trained: "build + first" is then the first ``evaluate()`` /
``predict()`` (its step built and compiled), "step" one batch (``step``:
the whole forward compiled; ``blocks``: each block's grad-free graph).

``--profile F`` profiles one more epoch of each configuration on rank 0
(torch.profiler's ops by self CPU time; with ``--python``, Python's cProfile
by own time, its raw data in ``F.CONFIG.prof``: the interpreter's share that
the op table leaves out).

    python benchmarks/blocks_steps.py [--layers 2,8] [--rounds 4]
        [--configs eager,step,blocks,guarded]
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
CONFIGS = ("eager", "step", "blocks")
BLOCKS = (
    "blocks",
    "guarded",
    "no-tail",
    "no-opt",
    "no-metrics",
)


def worker(args: argparse.Namespace) -> None:
    """Both ranks: every configuration's train function, then the rounds."""
    import keras
    import numpy as np
    import torch

    sys.path.insert(0, str(HERE))
    import hub_worker as hub

    from keras_dtensor_fix.compiled import plan, region, tail, update_groups

    torch.set_num_threads(1)
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
    rng = np.random.default_rng(0)
    ids = rng.integers(1, hub.VOCAB, size=(args.batch * args.steps, args.seq))
    ids = ids.astype("int32")
    data = ({"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, 1))
    configs = args.configs.split(",")
    unguarded = region._unguarded
    # As fit() does before it makes its step: the metrics' variables exist
    # (and get their layouts) before any step is traced.
    first = ({k: v[: args.batch] for k, v in data[0].items()}, data[1][: args.batch])
    model._symbolic_build(data_batch=first)

    class Steps(keras.callbacks.Callback):
        def began(self, batch, logs=None):
            self.start = time.perf_counter()

        def ended(self, batch, logs=None):
            times.append(time.perf_counter() - self.start)

        on_train_batch_begin = on_test_batch_begin = on_predict_batch_begin = began
        on_train_batch_end = on_test_batch_end = on_predict_batch_end = ended

    phase = args.phase
    made = {"fit": "train", "evaluate": "test", "predict": "predict"}[phase]

    def epoch() -> None:
        options = {"batch_size": args.batch, "verbose": 0, "callbacks": [Steps()]}
        if phase == "fit":
            model.fit(*data, epochs=1, shuffle=False, **options)
        elif phase == "evaluate":
            model.evaluate(*data, **options)
        else:
            model.predict(data[0], **options)

    own = tail.install, tail._metrics_in_region, update_groups.install

    def settings(config: str) -> None:
        """The functions ``config`` runs with (a part turned off), nothing installed."""
        off = lambda *_: "turned off"  # noqa: E731
        eager_metrics = lambda _: False  # noqa: E731
        tail.install = off if config == "no-tail" else own[0]
        tail._metrics_in_region = eager_metrics if config == "no-metrics" else own[1]
        update_groups.install = off if config == "no-opt" else own[2]
        plan.uninstall(model)

    def switch(config: str) -> None:
        # An eager step leaves the gradients on the weights; a compiled one
        # leaves none, and its guards say so: each configuration starts as in
        # its own fit().
        model.zero_grad(set_to_none=True)
        region._unguarded = (lambda: None) if config == "guarded" else unguarded
        settings(config)
        if config in BLOCKS:
            plan.install(model, phase == "fit")  # guards settle again
        setattr(model, f"{made}_function", functions[config])

    def profile(config: str) -> str:
        """One epoch of ``config`` under torch.profiler: ops by self CPU time."""
        nonlocal times
        switch(config)
        times = []
        epoch()  # settle after the switch
        if args.python:  # Python's own profiler: where the interpreter's time goes
            import cProfile
            import io
            import pstats

            with cProfile.Profile() as prof:
                times = []
                epoch()
            prof.dump_stats(f"{args.profile}.{config}.prof")
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(60)
            table = text.getvalue()
        else:
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities) as prof:
                times = []
                epoch()
            table = prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=70
            )
        step = 1e3 * statistics.median(times)
        return f"== {config}: {args.layers} layers, step {step:.0f} ms\n{table}"

    functions, starts = {}, {}
    for config in configs:
        if config == "guarded" and "blocks" in functions:
            functions[config], starts[config] = functions["blocks"], 0.0
            continue
        mode = "blocks" if config in BLOCKS else "step"
        os.environ["KERAS_DTENSOR_FIX_COMPILE"] = mode
        settings(config)
        model.jit_compile = config != "eager"
        model.zero_grad(set_to_none=True)
        setattr(model, f"{made}_function", None)
        began, times = time.perf_counter(), []
        getattr(model, f"make_{made}_function")()
        functions[config] = getattr(model, f"{made}_function")
        epoch()  # the compilation, and a first epoch
        starts[config] = time.perf_counter() - began
    rounds: dict[str, list[list[float]]] = {config: [] for config in configs}
    for _ in range(args.rounds):
        for config in configs:
            switch(config)
            times = []
            epoch()
            rounds[config].append(times)
    if args.profile:
        profiles = {config: profile(config) for config in configs}
    if int(os.environ.get("RANK", "0")) == 0:
        if args.profile:
            Path(args.profile).write_text("\n\n".join(profiles.values()))
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        Path(args.out).write_text(
            json.dumps({"rounds": rounds, "starts": starts, "breaks": breaks})
        )


def launch(args: argparse.Namespace, layers: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "result.json"
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        "--nproc_per_node=2", __file__, "--worker", f"--out={out}",
        f"--layers={layers}", f"--hidden={args.hidden}", f"--seq={args.seq}",
        f"--batch={args.batch}", f"--steps={args.steps}",
        f"--rounds={args.rounds}", f"--configs={args.configs}",
        f"--model={args.model}", f"--phase={args.phase}",
    ] + ([f"--profile={args.profile}"] if args.profile else []) + (
        ["--python"] if args.python else []
    )  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        return {"error": proc.stderr[-3000:]}
    return json.loads(out.read_text())


def report(layers: int, result: dict) -> None:
    rounds = result["rounds"]
    # A round's figure: the median of its steps past the first two (blocks
    # mode's guards settle over its first two steps after a switch).
    per_round = {
        config: [statistics.median(times[2:] or times) for times in runs]
        for config, runs in rounds.items()
    }

    def ratio(config: str, base: str) -> str:
        if base not in per_round:
            return "-"
        pairs = zip(per_round[config], per_round[base], strict=True)
        return f"{statistics.median(a / b for a, b in pairs):.2f}x"

    for config, medians in per_round.items():
        print(
            f"{layers} | {config} | {result['starts'][config]:.1f}"
            f" | {1e3 * statistics.median(medians):.0f}"
            f" | {ratio(config, 'eager')} | {ratio(config, 'step')}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--layers", default="2,8")
    parser.add_argument("--model", default="gpt", help="hub_worker.py's: gpt, gemma")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    phases = ("fit", "evaluate", "predict")
    parser.add_argument("--phase", default="fit", choices=phases)
    parser.add_argument("--json", help="write every launch's result here")
    parser.add_argument(
        "--python", action="store_true", help="--profile with cProfile, not torch's"
    )
    parser.add_argument(
        "--profile", help="rank 0: after the rounds, one profiled epoch each, here"
    )
    args = parser.parse_args()
    if args.worker:
        args.layers = int(args.layers)
        worker(args)
        return
    print(
        f"{args.model}, hidden {args.hidden}, seq {args.seq}, batch {args.batch},"
        f" {args.steps} steps a round, {args.rounds} rounds, 2 ranks, mesh (1, 2),"
        f" {args.phase}\n"
        "layers | config | build + first epoch s | step ms (median)"
        " | / eager (paired) | / whole step (paired)",
        flush=True,
    )
    results = {}
    for layers in [int(n) for n in args.layers.split(",")]:
        results[layers] = result = launch(args, layers)
        if "error" in result:
            print(f"{layers} | failed: {result['error'][-1500:]}", flush=True)
            continue
        report(layers, result)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
