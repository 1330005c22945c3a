"""``python -m keras_dtensor_fix demo``: why install the plugin, measured here (what
it runs, :func:`main` prints first); exit status 0 when the plugin's runs match."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: Epochs per run; the first is the warm-up (and compilation) and is not timed.
EPOCHS = 5
SAMPLES, BATCH = 1024, 32
STEPS = SAMPLES // BATCH  # per epoch
FEATURES, HIDDEN, OUTPUTS = 64, 512, 8
RTOL = 1e-5  # the plugin's losses against one process's
TIMEOUT_S = 240  # a run stuck in a collective is stopped
PROGRESS = "[demo] "  # a worker's lines for the parent to relay
RUNS = ("eager", "jit")
ENV_ENABLE = "KERAS_DTENSOR_FIX"  # off: upstream Keras as installed
COMPILES = "its first epoch compiles: about 25 s on 2 idle CPU cores, less with a "
COMPILES += "warm torch compile cache"
LAYOUT = {
    ".*hidden/kernel": (None, "model"),  # column parallel
    ".*hidden/bias": ("model",),
    ".*hidden2/kernel": ("model", None),  # row parallel
}


def set_model_parallel(
    layout: dict[str, tuple], devices: list[str] | None = None
) -> None:
    """Initialize the process group and set a (1, world) ModelParallel of
    ``layout`` (regex -> axes over batch, model); each process feeds whole batches."""
    import keras

    keras.distribution.initialize()
    devices = devices or keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map.update(layout)
    dist = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    dist.auto_shard_dataset = False
    keras.distribution.set_distribution(dist)


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _jit_warning(caught: Sequence[warnings.WarningMessage]) -> str:
    return next((str(w.message) for w in caught if "jit_compile" in str(w.message)), "")


def _train(jit_compile: bool, say: Any) -> dict[str, Any]:
    """Build, compile and fit the demo model; losses and epoch times."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(42)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, OUTPUTS)) / np.sqrt(FEATURES)
    y = (x @ w + 0.1 * rng.normal(size=(SAMPLES, OUTPUTS))).astype("float32")
    dense = keras.layers.Dense
    hidden = [dense(HIDDEN, activation="relu", name=n) for n in ("hidden", "hidden2")]
    output = dense(OUTPUTS, name="output")
    model = keras.Sequential([keras.layers.Input((FEATURES,)), *hidden, output])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=jit_compile
    )
    times: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            times.append(time.perf_counter() - self.start)
            loss = (logs or {}).get("loss", float("nan"))
            ms = 1000 * times[-1] / STEPS
            say(
                f"  epoch {epoch + 1}/{EPOCHS}: {times[-1]:.1f} s "
                f"({ms:.0f} ms/step), loss {loss:.6f}"
            )

    graphs = _dynamo_graphs()
    with warnings.catch_warnings(record=True, action="always") as caught:
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[Clock()],
        )
    kernel = model.get_layer("hidden").kernel.value
    return {
        "losses": [float(v) for v in history.history["loss"]],
        "epoch_s": times,
        # The median: other jobs on the machine add noise.
        "ms_per_step": 1000 * statistics.median(times[1:]) / STEPS,
        "compiled": _dynamo_graphs() > graphs,  # measured, not assumed
        "jit_refused": _jit_warning(caught),
        "kernel": f"{type(kernel).__name__} {getattr(kernel, 'placements', '')}",
    }


def _jit_probe() -> str:
    """Why this Keras refuses jit_compile=True here, or ``""``."""
    import keras

    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    if (use := getattr(model, "_use_torch_compile", None)) is None:
        return ""
    with warnings.catch_warnings(record=True, action="always") as caught:
        if use():
            return ""
    return _jit_warning(caught) or "runs eagerly"


def _worker(out: Path, runs: Sequence[str]) -> None:
    """Run ``runs`` ("eager", "jit") in this process; rank 0 writes ``out``."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import torch

    import keras_dtensor_fix  # activates unless KERAS_DTENSOR_FIX is off
    from keras_dtensor_fix.ops.first_call import first_line

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def say(line: str) -> None:
        if rank == 0:
            print(PROGRESS + line, flush=True)

    report: dict[str, Any] = {"plugin_active": keras_dtensor_fix.is_active()}
    report["runs"] = {}
    if world > 1:
        set_model_parallel(LAYOUT)  # imports Keras: the plugin's patches land
        try:
            report["jit_probe"] = _jit_probe()
        except Exception as exc:  # noqa: BLE001 - a probe must not stop the demo
            report["jit_probe"] = f"probe failed: {first_line(exc)}"
    for run in runs:
        say(f"{run}: training {EPOCHS} epochs of {STEPS} steps")
        try:
            result = _train(run == "jit", say)
        except Exception as exc:  # noqa: BLE001 - upstream's failure is a result
            result = {"error": first_line(exc)}
            say(f"{run}: failed: {result['error']}")
        report["runs"][run] = result
    report["dispatch_modes"] = [
        type(m).__name__
        for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    ]
    if rank == 0:
        out.write_text(json.dumps(report))
    if world > 1 and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _launch(
    title: str, out: Path, runs: Sequence[str], *, ranks: int, plugin: bool
) -> dict[str, Any]:
    """Run the workers in a child process; relay their progress; their report."""
    worker = ["-m", "keras_dtensor_fix.demo", "--worker", str(out), *runs]
    if ranks > 1:
        launcher = ["-m", "torch.distributed.run", "--standalone"]
        worker = [*launcher, f"--nproc_per_node={ranks}", *worker]
    # A demo started inside a launcher must not inherit its rank.
    launcher_env = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in launcher_env}
    env.update(KERAS_BACKEND="torch", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env[ENV_ENABLE] = "1" if plugin else "0"
    print(f"\n{title}", flush=True)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, *worker],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # so a stuck run can be stopped whole
    )
    tail: deque[str] = deque(maxlen=40)

    def relay() -> None:
        for line in proc.stdout:
            if line.startswith(PROGRESS):
                print(line[len(PROGRESS) :].rstrip(), flush=True)
            else:
                tail.append(line)

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    reader.join(timeout=10)
    if out.exists():
        report = json.loads(out.read_text())
    else:  # a crash or a hang before rank 0 wrote its report: its last words
        lines = [line.strip() for line in tail if line.strip()]
        why = f"no result after {TIMEOUT_S} s" if code is None else f"exit {code}"
        errors = [line for line in lines if "Error" in line] or lines[-1:] or [""]
        report = {"runs": {run: {"error": f"{why}: {errors[-1]}"} for run in runs}}
        sys.stderr.write("".join(tail))
    print(f"  done in {time.perf_counter() - start:.0f} s", flush=True)
    return report


def _speed(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"fails: {run['error']}"
    text = f"{run['ms_per_step']:.1f} ms/step"
    if run.get("jit") and not run["compiled"]:
        text += f" (not compiled: {run['jit_refused'] or 'runs eagerly'})"
    return text


def _ratio(slow: float, fast: float) -> str:
    ratio = slow / fast
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.1f}x slower"


def main(argv: list[str] | None = None) -> int:
    """Run the demonstration; exit status 0 when the plugin's losses agree."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_dtensor_fix demo",
        description="Time one 2-process ModelParallel training script with the "
        "plugin off (upstream Keras) and on; check its losses against one process.",
    )
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("runs", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        if unknown := sorted(set(args.runs) - set(RUNS)):
            parser.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
        _worker(args.worker, args.runs or ["eager"])
        # No interpreter teardown: a gloo thread still releasing tensors
        # aborts the process (SIGABRT) during finalization.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.runs:
        parser.error(f"unrecognized arguments: {' '.join(args.runs)}")
    print(
        "Why install keras-dtensor-fix: one training script, with the plugin off and "
        f"on.\n  model.fit of a {FEATURES}-{HIDDEN}-{HIDDEN}-{OUTPUTS} MLP (Adam, "
        f"{EPOCHS} epochs of {STEPS} steps)\n  under ModelParallel on 2 CPU processes "
        "(gloo), hidden kernels sharded column- and\n  row-wise; then one process for "
        "the reference losses. Time per step: the median\n  of the epochs after the "
        "first.",
        flush=True,
    )
    started = time.perf_counter()
    phases = [  # title, processes, plugin on (eager, then jit)
        (f"plugin OFF ({ENV_ENABLE}=0: upstream Keras), 2 processes, eager", 2, False),
        (f"plugin ON, 2 processes, eager, then jit_compile=True ({COMPILES})", 2, True),
        ("reference: 1 process, no distribution, plugin off", 1, False),
    ]
    with tempfile.TemporaryDirectory() as tmp:
        reports = [
            _launch(
                f"[{i}/3] {title}",
                Path(tmp, f"{i}.json"),
                ["eager", "jit"] if plugin else ["eager"],
                ranks=ranks,
                plugin=plugin,
            )
            for i, (title, ranks, plugin) in enumerate(phases, 1)
        ]
    return report(*reports, time.perf_counter() - started)


def report(
    upstream: dict[str, Any],
    plugin: dict[str, Any],
    single: dict[str, Any],
    elapsed: float,
) -> int:
    """Print the comparison of the three launches' reports; the exit status.

    FAIL (1) when a plugin run did not finish, its losses differ from one process's by
    more than :data:`RTOL`, or a dispatch mode was active with the plugin. Upstream's
    speed or failure is reported, never a failure."""
    up = upstream["runs"]["eager"]
    eager = plugin["runs"]["eager"]
    jit = {**plugin["runs"].get("jit", {"error": "did not run"}), "jit": True}
    ref = single["runs"]["eager"]
    rows = [
        ("upstream", "upstream Keras (plugin off), eager", up),
        ("plugin", "plugin, eager", eager),
        ("plugin jit", "plugin, jit_compile=True", jit),
        ("1 process", "1 process (reference)", ref),
    ]
    print(f"\nResults ({elapsed:.0f} s in all)")
    for _, name, run in rows:
        print(f"  {name + ':':<37} {_speed(run)}")
    if upstream.get("jit_probe"):
        print(f"upstream with jit_compile=True: {upstream['jit_probe']}")
    if "kernel" in eager:
        print(f"hidden/kernel on rank 0 with the plugin: {eager['kernel']}")
    modes = plugin.get("dispatch_modes")
    listed = ", ".join(modes or ()) or "none"
    print(f"dispatch modes active during training with the plugin: {listed}")
    finished = [(short, run) for short, _, run in rows if "losses" in run]
    if len(finished) > 1:
        print("\n" + "epoch" + "".join(f"  {short:>12}" for short, _ in finished))
        for epoch in range(EPOCHS):
            cells = "".join(f"  {run['losses'][epoch]:>12.6f}" for _, run in finished)
            print(f"{epoch + 1:>5}{cells}")

    problems, worst = [], 0.0
    for name, run in (("eager", eager), ("jit_compile=True", jit)):
        if "losses" not in run or "losses" not in ref:
            problems.append(f"plugin {name} did not finish ({run.get('error')})")
            continue
        for a, b in zip(run["losses"], ref["losses"], strict=True):
            worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
    if worst > RTOL:
        problems.append(f"plugin losses differ from one process by {worst:.1e}")
    if modes:
        problems.append("a dispatch mode was active with the plugin")
    if plugin.get("plugin_active") is False:
        problems.append("the plugin was not active in its run (see its status)")
    if upstream.get("plugin_active"):
        problems.append(f"the plugin was active with {ENV_ENABLE}=0")

    parts = []
    if "error" in up:
        parts.append(f"upstream Keras fails ({up['error']})")
        if "ms_per_step" in eager:
            parts.append(f"plugin eager {eager['ms_per_step']:.1f} ms/step")
    elif "ms_per_step" in eager:
        parts.append(
            f"plugin eager {_ratio(up['ms_per_step'], eager['ms_per_step'])} "
            f"than upstream Keras ({eager['ms_per_step']:.1f} vs "
            f"{up['ms_per_step']:.1f} ms/step)"
        )
    if "ms_per_step" in jit:
        how = "compiled" if jit["compiled"] else "jit_compile=True (ran eagerly)"
        if "ms_per_step" in up:
            how += f" {_ratio(up['ms_per_step'], jit['ms_per_step'])}"
            parts.append(f"{how} ({jit['ms_per_step']:.1f} ms/step)")
        else:
            parts.append(f"{how} {jit['ms_per_step']:.1f} ms/step")
    if not problems:
        parts.append(f"losses match one process to {worst:.0e}")
    verdict = "FAIL" if problems else "PASS"
    print(f"\n{verdict}: " + "; ".join(parts + problems), flush=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
