"""The one-GPU checks (``nox -s gpu``): one process, plugin on = off on CUDA.

The demo's model (an MLP, Megatron column/row layout) under a ``(1, 1)``
ModelParallel on ``cuda:0``, trained by ``demo._train`` in four fresh
processes: plugin off (``KERAS_DTENSOR_FIX=0``, upstream) and on, each eager
and with ``jit_compile=True``. Passes when each plugin run's losses equal
upstream's of the same mode (rtol 1e-5) and the plugin's compiled run made
dynamo graphs; prints the card, the date and each run's ms/step for
benchmarks/results. Without a CUDA device it prints one line saying so and
exits 0; ``--cpu`` runs the same checks on the CPU (to test this script).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys

SKIP = "gpu: skipped: no CUDA device here (torch.cuda.is_available() is False)"
RTOL = 1e-5
#: The demo's layout over ("batch", "model").
LAYOUT = {
    ".*hidden/kernel": (None, "model"),
    ".*hidden/bias": ("model",),
    ".*hidden2/kernel": ("model", None),
}


def _worker(jit: bool, device: str) -> None:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    import keras_dtensor_fix  # noqa: F401 - on unless KERAS_DTENSOR_FIX=0
    from keras_dtensor_fix import demo

    demo.set_model_parallel(LAYOUT, devices=[f"{device}:0"])
    result = demo._train(jit, say=lambda line: None)
    print("RESULT " + json.dumps(result), flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(plugin: bool, jit: bool, device: str) -> dict:
    env = {
        **os.environ,
        "KERAS_BACKEND": "torch",
        "KERAS_DTENSOR_FIX": "1" if plugin else "0",
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
    }
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = [sys.executable, __file__, "--worker", device] + (["--jit"] if jit else [])
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=540)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"exit {proc.returncode}: {tail[0]}"}


def _same(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        abs(x - y) <= RTOL * max(abs(x), abs(y), 1e-12)
        for x, y in zip(a, b, strict=True)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on the CPU")
    parser.add_argument("--worker", choices=("cuda", "cpu"), help=argparse.SUPPRESS)
    parser.add_argument("--jit", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.jit, args.worker)
        return 0
    import torch

    if not args.cpu and not torch.cuda.is_available():
        print(SKIP)
        return 0
    device = "cpu" if args.cpu else "cuda"
    card = torch.cuda.get_device_name(0) if device == "cuda" else "CPU"
    print(f"gpu: {datetime.date.today()} on {card}, torch {torch.__version__}")
    failures = []
    for jit in (False, True):
        mode = "jit_compile=True" if jit else "eager"
        off, on = (_run(plugin, jit, device) for plugin in (False, True))
        for name, run in (("plugin off", off), ("plugin on", on)):
            speed = run.get("error") or f"{run['ms_per_step']:.2f} ms/step"
            print(f"  {mode:16} {name:10}: {speed}")
        if "error" in on:
            failures.append(f"{mode}: plugin on failed: {on['error']}")
        elif "error" not in off and not _same(on["losses"], off["losses"]):
            failures.append(f"{mode}: losses differ: {on['losses']} {off['losses']}")
        elif jit and not on["compiled"]:
            failures.append(f"{mode}: the plugin's run made no compiled graph")
    for failure in failures:
        print(f"gpu: FAILED: {failure}")
    if not failures:
        print("gpu: passed: plugin on = off, eager and compiled")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
