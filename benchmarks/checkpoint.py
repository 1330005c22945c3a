"""What saving during ``fit()`` costs: step time with a save every N steps.

Run as ``python benchmarks/checkpoint.py [--rounds R] [--every N]``: it
launches itself on 2 CPU ranks (gloo, ModelParallel (1, 2), Megatron MLP).
In the same two processes, interleaved round by round, each configuration
fits a fresh model for 2 epochs of ``--steps`` steps and times the second
epoch (``fit()`` as users call it, the save's wait at the end included):

- ``none``: no callback;
- ``background``: ``keras_dtensor_fix.checkpoint.Checkpoint(save_freq=N)``
  (sharded, written by a thread while training goes on, the default);
- ``sync``: the same with ``save_on_background=False``;
- ``keras-h5``: ``keras.callbacks.ModelCheckpoint(path, save_weights_only=True,
  save_freq=N)`` to one shared path (gathered, one process writes);
- ``unwatched`` and ``watched``: ``Checkpoint`` that never saves in the
  timed epoch, with ``signals=()`` and with its default (SIGTERM watched: a
  thread polls the group's store, the training thread passes a gate at each
  step), for the cost of watching.

``--configs`` picks some (default: all). With ``watched``, it also times
the watcher alone on the training thread: 300 calls 5 ms apart, as at the
ends of 300 steps of 5 ms.

Prints ms per step (median over rounds) and each configuration's ratio to
``none`` paired by round; ``--json FILE`` keeps them.
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
import time

CONFIGS = ("none", "background", "sync", "keras-h5", "unwatched", "watched")
NEVER = 10**9  # a save_freq that saves nothing


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--json", default=None)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    args.configs = tuple(c for c in args.configs.split(",") if c)
    unknown = set(args.configs) - set(CONFIGS)
    if unknown or "none" not in args.configs:
        parser.error(f"--configs: one or more of {CONFIGS}, 'none' among them")
    return args


def launch(args: argparse.Namespace) -> int:
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        __file__,
        "--worker",
        *sys.argv[1:],
    ]
    return subprocess.run(command, env=env).returncode


class EpochTimer:
    """The second epoch's wall time, the end of training's wait included."""

    def __new__(cls):
        import keras

        class Timer(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                if epoch == 1:
                    self.start = time.perf_counter()

            def on_train_end(self, logs=None):
                self.seconds = time.perf_counter() - self.start

        return Timer()


def worker(args: argparse.Namespace) -> None:
    import keras
    import numpy as np
    import torch.distributed as dist

    from keras_dtensor_fix.checkpoint import Checkpoint

    keras.distribution.initialize()
    rank = dist.get_rank()
    mesh = keras.distribution.DeviceMesh(
        (1, 2), ["batch", "model"], keras.distribution.list_devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")
    layout_map[".*hidden/bias"] = ("model",)
    layout_map[".*output/kernel"] = ("model", None)
    dist_ = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    dist_.auto_shard_dataset = False
    keras.distribution.set_distribution(dist_)
    rng = np.random.default_rng(0)
    batch = 32
    x = rng.normal(size=(args.steps * batch, 256)).astype("float32")
    y = rng.normal(size=(args.steps * batch, 256)).astype("float32")
    root = dist.get_rank() == 0 and tempfile.mkdtemp(prefix="kdf-ckpt-bench-")
    box = [root]
    dist.broadcast_object_list(box, src=0)
    root = box[0]

    def callback(config: str, where: str):
        if config == "background":
            return [Checkpoint(where, save_freq=args.every, restore=False)]
        if config == "sync":
            return [
                Checkpoint(
                    where, save_freq=args.every, save_on_background=False, restore=False
                )
            ]
        if config in ("unwatched", "watched"):
            signals = () if config == "unwatched" else (signal.SIGTERM,)
            return [Checkpoint(where, save_freq=NEVER, restore=False, signals=signals)]
        if config == "keras-h5":
            path = os.path.join(where, "w.weights.h5")
            return [
                keras.callbacks.ModelCheckpoint(
                    path, save_weights_only=True, save_freq=args.every
                )
            ]
        return []

    times: dict[str, list[float]] = {config: [] for config in args.configs}
    for round_ in range(args.rounds):
        for config in args.configs:
            model = keras.Sequential(
                [
                    keras.layers.Input((256,)),
                    keras.layers.Dense(args.width, activation="relu", name="hidden"),
                    keras.layers.Dense(256, name="output"),
                ]
            )
            model.compile(optimizer="adam", loss="mse")
            timer = EpochTimer()
            where = os.path.join(root, f"{config}-{round_}")
            model.fit(
                x,
                y,
                batch_size=batch,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=[*callback(config, where), timer],
            )
            times[config].append(timer.seconds / args.steps * 1000)
    poll_us = poll_cost() if "watched" in args.configs else None
    if rank == 0:
        report(times, args)
        if poll_us is not None:
            step = statistics.median(times["none"]) * 1000
            print(
                f"watching, per step on the training thread: {poll_us:.1f} us "
                f"mean over 300 steps of 5 ms ({poll_us / 5000 * 100:.2f}%; "
                f"{poll_us / step * 100:.2f}% of the no-callback step)"
            )
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def poll_cost(polls: int = 300) -> float:
    """Mean microseconds the watcher costs the training thread per step: the
    ``begin_step``, ``end_step`` and ``gate`` calls ``Checkpoint`` makes around
    each step, with 5 ms of "step" between them, its thread watching the
    store meanwhile (every process in step)."""
    from keras_dtensor_fix.checkpoint.preemption import Watcher

    watcher = Watcher([signal.SIGTERM], timeout=60)
    watcher.start(lambda *_: None)
    spent = []
    for _ in range(polls):
        begin = time.perf_counter()
        watcher.begin_step()
        spent.append(time.perf_counter() - begin)
        time.sleep(0.005)
        begin = time.perf_counter()
        watcher.end_step()
        watcher.gate()
        spent[-1] = (spent[-1] + time.perf_counter() - begin) * 1e6
    watcher.stop()
    median = statistics.median(spent)
    print(
        f"watching, per step on the training thread: median {median:.1f} us, "
        f"max {max(spent):.0f} us",
        flush=True,
    )
    return statistics.fmean(spent)


def report(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    base = times["none"]
    result = {"args": vars(args), "ms_per_step": {}, "paired_ratio_to_none": {}}
    print(
        f"2 ranks, (1, 2), MLP 256-{args.width}-256, Adam, batch 32, "
        f"{args.steps} steps an epoch, a save every {args.every}, {args.rounds} rounds"
    )
    print(f"{'config':<12}{'ms/step':>10}{'paired / none':>16}")
    for config, values in times.items():
        ratios = [v / b for v, b in zip(values, base, strict=True)]
        median, ratio = statistics.median(values), statistics.median(ratios)
        result["ms_per_step"][config] = values
        result["paired_ratio_to_none"][config] = ratio
        print(f"{config:<12}{median:>10.2f}{ratio:>15.3f}x")
    if "watched" in times and "unwatched" in times:
        ratios = [
            w / u for w, u in zip(times["watched"], times["unwatched"], strict=True)
        ]
        result["watched_over_unwatched"] = statistics.median(ratios)
        print(f"watching SIGTERM, paired / unwatched: {statistics.median(ratios):.4f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(result, handle, indent=1)


if __name__ == "__main__":
    if "--worker" in sys.argv:
        sys.argv.remove("--worker")
        worker(parse())
    else:
        sys.exit(launch(parse()))
