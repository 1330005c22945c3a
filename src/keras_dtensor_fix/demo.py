"""``python -m keras_dtensor_fix demo``: why install the plugin, measured here.

Runs one training script (an MLP with Megatron-style column/row sharded
kernels under ``keras.distribution.ModelParallel``, ``model.fit`` on 2 CPU
processes over gloo) twice: with the plugin off (``KERAS_DTENSOR_FIX=0``,
upstream Keras as installed) and with it on (eager, then
``jit_compile=True``). Then the same model on one process gives the reference
losses. It prints each phase as it runs, the time per step of each run
(after a warm-up epoch), the losses side by side, and a verdict. Exit status
0 when the plugin's runs match the one-process losses.
"""

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
#: Losses of the plugin's runs must match the one-process run to this.
RTOL = 1e-5
#: A run that takes longer than this is stopped (a rank stuck in a collective).
TIMEOUT_S = 240
#: Lines a worker prints for the parent to relay start with this.
PROGRESS = "[demo] "
#: What a worker can run: the training eagerly, or with jit_compile=True.
RUNS = ("eager", "jit")
#: The plugin's switch: off gives upstream Keras as installed.
ENV_ENABLE = "KERAS_DTENSOR_FIX"


def set_model_parallel(
    layout: dict[str, tuple], devices: list[str] | None = None
) -> None:
    """Initialize the process group and set a (1, world) ModelParallel.

    ``layout`` maps LayoutMap regexes to axes over ``("batch", "model")``;
    ``devices`` (one per rank, default ``list_devices()``) names the mesh's.
    Every process feeds whole batches (``auto_shard_dataset = False``).
    """
    import keras

    keras.distribution.initialize()
    devices = devices or keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, len(devices)), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    for key, axes in layout.items():
        layout_map[key] = axes
    dist = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    dist.auto_shard_dataset = False
    keras.distribution.set_distribution(dist)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _train(jit_compile: bool, say: Any) -> dict[str, Any]:
    """Build, compile and fit the demo model; losses and epoch times."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(42)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, OUTPUTS)) / np.sqrt(FEATURES)
    y = (x @ w + 0.1 * rng.normal(size=(SAMPLES, OUTPUTS))).astype("float32")
    model = keras.Sequential(
        [
            keras.layers.Input((FEATURES,)),
            keras.layers.Dense(HIDDEN, activation="relu", name="hidden"),
            keras.layers.Dense(HIDDEN, activation="relu", name="hidden2"),
            keras.layers.Dense(OUTPUTS, name="output"),
        ]
    )
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
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
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
        # The median of the timed epochs: other jobs on the machine add noise.
        "ms_per_step": 1000 * statistics.median(times[1:]) / STEPS,
        # Measured, not assumed: graphs dynamo made during fit.
        "compiled": _dynamo_graphs() > graphs,
        "jit_refused": _jit_warning(caught),
        "kernel": f"{type(kernel).__name__} {getattr(kernel, 'placements', '')}",
    }


def _dynamo_graphs() -> int:
    """How many graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _jit_warning(caught: Sequence[warnings.WarningMessage]) -> str:
    """The first warning about ``jit_compile`` (why a step was not compiled)."""
    return next((str(w.message) for w in caught if "jit_compile" in str(w.message)), "")


def _jit_probe() -> str:
    """Why this Keras (plugin on or off) refuses jit_compile=True, or ``""``.

    Asks the trainer about a small model under the current distribution
    without training it; ``""`` too where the trainer has no such question.
    """
    import keras

    model = keras.Sequential([keras.layers.Input((4,)), keras.layers.Dense(2)])
    model.compile(optimizer="adam", loss="mse", jit_compile=True)
    use = getattr(model, "_use_torch_compile", None)
    if use is None:  # an older trainer, which does not say
        return ""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if use():
            return ""
    return _jit_warning(caught) or "runs eagerly"


def _worker(out: Path, runs: Sequence[str]) -> None:
    """Run ``runs`` ("eager", "jit") in this process; rank 0 writes ``out``."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import torch

    import keras_dtensor_fix  # activates unless KERAS_DTENSOR_FIX is off

    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))

    def say(line: str) -> None:
        if rank == 0:
            print(PROGRESS + line, flush=True)

    if world > 1:
        set_model_parallel(
            {
                ".*hidden/kernel": (None, "model"),  # column parallel
                ".*hidden/bias": ("model",),
                ".*hidden2/kernel": ("model", None),  # row parallel
            }
        )
    report: dict[str, Any] = {
        "world": world,
        "plugin_active": keras_dtensor_fix.is_active(),
        "torch": torch.__version__,
        "runs": {},
    }
    if world > 1:
        try:
            report["jit_probe"] = _jit_probe()
        except Exception as exc:  # noqa: BLE001 - a probe must not stop the demo
            report["jit_probe"] = f"probe failed: {_first_line(exc)}"
    for run in runs:
        say(f"{run}: training {EPOCHS} epochs of {STEPS} steps")
        try:
            result = _train(run == "jit", say)
        except Exception as exc:  # noqa: BLE001 - upstream's failure is a result
            result = {"error": _first_line(exc)}
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
    env = {
        **{k: v for k, v in os.environ.items() if k not in launcher_env},
        "KERAS_BACKEND": "torch",
        # One thread per process: the ranks share the cores.
        "OMP_NUM_THREADS": "1",
        ENV_ENABLE: "1" if plugin else "0",
        "PYTHONUNBUFFERED": "1",
    }
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
    elapsed = time.perf_counter() - start
    if out.exists():
        report = json.loads(out.read_text())
    else:
        # A crash (or a hang) before rank 0 wrote its report: its last words.
        lines = [line.strip() for line in tail if line.strip()]
        why = f"no result after {TIMEOUT_S} s" if code is None else f"exit {code}"
        error = next(
            (line for line in reversed(lines) if "Error" in line),
            lines[-1] if lines else "",
        )
        report = {"runs": {run: {"error": f"{why}: {error}"} for run in runs}}
        sys.stderr.write("".join(tail))
    print(f"  done in {elapsed:.0f} s", flush=True)
    return report


def _speed(run: dict[str, Any]) -> str:
    if "error" in run:
        return f"fails: {run['error']}"
    text = f"{run['ms_per_step']:.1f} ms/step"
    if run.get("jit") and not run["compiled"]:
        text += f" (not compiled: {run['jit_refused'] or 'runs eagerly'})"
    return text


def _worst(losses: Sequence[float], reference: Sequence[float]) -> float:
    """The largest relative difference, epoch by epoch."""
    return max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, reference, strict=True)
    )


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
        unknown = sorted(set(args.runs) - set(RUNS))
        if unknown:
            parser.error(f"unknown runs {unknown}; known: {', '.join(RUNS)}")
        _worker(args.worker, args.runs or ["eager"])
        # Skip the interpreter's teardown: a gloo thread still releasing the
        # last collective's tensors needs the GIL, and during finalization it
        # aborts the process (SIGABRT) after the report is written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    if args.runs:
        parser.error(f"unrecognized arguments: {' '.join(args.runs)}")

    print(
        "Why install keras-dtensor-fix: one training script, with the plugin off "
        "and on.\n"
        f"  model.fit of a {FEATURES}-{HIDDEN}-{HIDDEN}-{OUTPUTS} MLP (Adam, "
        f"{EPOCHS} epochs of {STEPS} steps) under ModelParallel on 2 CPU\n"
        "  processes (gloo), hidden kernels sharded column- and row-wise; then "
        "one process\n"
        "  for the reference losses. Time per step: the median of the epochs "
        "after the first.",
        flush=True,
    )
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        upstream = _launch(
            f"[1/3] plugin OFF ({ENV_ENABLE}=0: upstream Keras), 2 processes, eager",
            Path(tmp, "upstream.json"),
            ["eager"],
            ranks=2,
            plugin=False,
        )
        plugin = _launch(
            "[2/3] plugin ON, 2 processes, eager, then jit_compile=True "
            "(its first epoch compiles: 80 s on 2 CPU cores, less with a "
            "warm torch compile cache)",
            Path(tmp, "plugin.json"),
            ["eager", "jit"],
            ranks=2,
            plugin=True,
        )
        single = _launch(
            "[3/3] reference: 1 process, no distribution, plugin off",
            Path(tmp, "single.json"),
            ["eager"],
            ranks=1,
            plugin=False,
        )
    return report(upstream, plugin, single, time.perf_counter() - started)


def report(
    upstream: dict[str, Any],
    plugin: dict[str, Any],
    single: dict[str, Any],
    elapsed: float,
) -> int:
    """Print the comparison of the three launches' reports; the exit status.

    FAIL (1) when a plugin run did not finish, its losses differ from one
    process's by more than :data:`RTOL`, or a dispatch mode was active with the
    plugin. Upstream's speed or failure is reported, never a failure.
    """
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

    problems = []
    worst = 0.0
    for name, run in (("eager", eager), ("jit_compile=True", jit)):
        if "losses" not in run or "losses" not in ref:
            problems.append(f"plugin {name} did not finish ({run.get('error')})")
        else:
            worst = max(worst, _worst(run["losses"], ref["losses"]))
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
