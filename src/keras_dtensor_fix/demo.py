"""``python -m keras_dtensor_fix demo``: 2-process CPU ModelParallel training.

Launches ``torch.distributed.run`` with 2 gloo ranks that train a small MLP
(Megatron-style column/row sharded kernels) under
``keras.distribution.ModelParallel`` with the fix active, then the same model
on one process, and prints the per-epoch losses side by side with a verdict.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

EPOCHS = 5
RTOL = 1e-5


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


def _worker(out: Path, jit_compile: bool) -> None:
    """Train the demo model; rank 0 (or the single process) writes ``out``."""
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras
    import numpy as np
    import torch

    import keras_dtensor_fix  # noqa: F401  (activates, also without the .pth)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        set_model_parallel(
            {
                ".*hidden/kernel": (None, "model"),  # column parallel
                ".*hidden/bias": ("model",),
                ".*output/kernel": ("model", None),  # row parallel
            }
        )

    keras.utils.set_random_seed(42)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 32)).astype("float32")
    y = (x @ rng.normal(size=(32, 4)) + 0.1 * rng.normal(size=(256, 4))).astype(
        "float32"
    )
    model = keras.Sequential(
        [
            keras.layers.Input((32,)),
            keras.layers.Dense(128, activation="relu", name="hidden"),
            keras.layers.Dense(4, name="output"),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss="mse", jit_compile=jit_compile
    )
    history = model.fit(x, y, batch_size=32, epochs=EPOCHS, shuffle=False, verbose=0)
    modes = [
        type(m).__name__
        for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack()
    ]
    kernel = model.get_layer("hidden").kernel.value
    report = {
        "world": world,
        "losses": [float(v) for v in history.history["loss"]],
        "dispatch_modes": modes,
        "kernel": f"{type(kernel).__name__} {getattr(kernel, 'placements', '')}",
    }
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(report))
    if world > 1:
        torch.distributed.destroy_process_group()


def _run(command: list[str]) -> None:
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        raise SystemExit(f"demo: {' '.join(command[:6])}... exited {proc.returncode}")


def main(argv: list[str] | None = None) -> int:
    """Run the demonstration; exit status 0 when the losses agree."""
    parser = argparse.ArgumentParser(prog="python -m keras_dtensor_fix demo")
    parser.add_argument("--jit", action="store_true", help="jit_compile=True")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.worker, args.jit)
        return 0

    flags = ["--jit"] if args.jit else []
    with tempfile.TemporaryDirectory() as tmp:
        sharded, single = Path(tmp, "sharded.json"), Path(tmp, "single.json")
        module = [sys.executable, "-m", "keras_dtensor_fix.demo"]
        print("Training a 32-128-4 MLP with Adam for", EPOCHS, "epochs ...")
        print(" * 2 CPU processes (gloo), ModelParallel, kernels sharded")
        _run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "keras_dtensor_fix.demo",
                "--worker",
                str(sharded),
                *flags,
            ]
        )
        print(" * 1 process, no distribution (reference)")
        _run([*module, "--worker", str(single), *flags])
        a, b = json.loads(sharded.read_text()), json.loads(single.read_text())

    print(f"\nhidden/kernel on rank 0: {a['kernel']}")
    print(f"dispatch modes active during training: {a['dispatch_modes'] or 'none'}")
    print(f"\n{'epoch':>5}  {'2 ranks':>12}  {'1 process':>12}  {'rel diff':>9}")
    worst = 0.0
    for epoch, (x, y) in enumerate(zip(a["losses"], b["losses"], strict=True), 1):
        rel = abs(x - y) / max(abs(y), 1e-12)
        worst = max(worst, rel)
        print(f"{epoch:>5}  {x:>12.6f}  {y:>12.6f}  {rel:>9.1e}")
    ok = worst <= RTOL and not a["dispatch_modes"]
    verdict = "PASS" if ok else "FAIL"
    print(
        f"\n{verdict}: sharded losses {'match' if worst <= RTOL else 'differ from'} "
        f"the single-process run (worst relative difference {worst:.1e}, "
        f"tolerance {RTOL:.0e})"
        + ("" if not a["dispatch_modes"] else "; a dispatch mode was active")
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
