"""The plugin's source files one steady compiled blocks-mode train step enters.

One 2-rank launch (torchrun, gloo, mesh (1, 2); ``--ranks 1``: one process, mesh
(1, 1)) trains a small GPT decoder
of keras-hub ``TransformerDecoder`` blocks (the shape of
``tests/multiprocess/cases_hub.tiny_gpt``, Megatron's layout by hand) with
``jit_compile=True`` and ``KERAS_DTENSOR_FIX_COMPILE=blocks``, an accuracy
metric and Adam. After ``--warmup`` steps (the blocks' guards settled), rank 0
records with ``sys.setprofile`` every ``keras_dtensor_fix`` file a Python
call enters during one step (``on_train_batch_begin`` to ``_end``: the train
function alone) and prints them, each with its number of calls. ``--entries``
also prints each hand-back: a plugin function called from outside the plugin
(Keras, keras-hub, torch's autograd), with its caller.

``--src DIR`` imports the plugin from another checkout's ``src`` (before and
after a change).

    flock /tmp/kdf-cpu.lock python benchmarks/step_files.py [--layers 4]
        [--ranks 1] [--src ../old/src] [--functions] [--entries] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

PACKAGE = "keras_dtensor_fix"


def worker(args: argparse.Namespace) -> None:
    import keras
    import keras_hub
    import numpy as np
    import torch

    import keras_dtensor_fix

    torch.set_num_threads(1)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # --ranks 1: no torchrun
    keras.distribution.initialize()
    mesh = keras.distribution.DeviceMesh(
        (1, ranks), ["batch", "model"], keras.distribution.list_devices()[:ranks]
    )
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import hub_worker  # Megatron's layout of the GPT decoder

    distribution = keras.distribution.ModelParallel(
        layout_map=hub_worker.layout_map("gpt", mesh), batch_dim_name="batch"
    )
    distribution.auto_shard_dataset = False
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)

    ids = keras.Input((args.seq,), dtype="int32", name="token_ids")
    x = keras_hub.layers.TokenAndPositionEmbedding(64, args.seq, args.hidden)(ids)
    for i in range(args.layers):
        x = keras_hub.layers.TransformerDecoder(
            2 * args.hidden, 4, name=f"decoder_{i}"
        )(x)
    model = keras.Model(ids, keras.layers.Dense(64, name="lm_head")(x))
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        jit_compile=True,
    )
    steps = args.warmup + 1
    tokens = np.random.default_rng(0).integers(1, 64, size=(4 * steps, args.seq))
    tokens = tokens.astype("int32")
    calls: collections.Counter = collections.Counter()
    functions: collections.Counter = collections.Counter()
    entries: collections.Counter = collections.Counter()
    root = str(Path(keras_dtensor_fix.__file__).parent)

    armed: list[bool] = []

    def profile(frame, event, arg):
        if event == "call":
            name = frame.f_code.co_filename
            if name.startswith(root):
                calls[os.path.relpath(name, root)] += 1
                here = f"{os.path.relpath(name, root)}:{frame.f_code.co_name}"
                functions[here] += 1
                back = frame.f_back
                if back is not None and not back.f_code.co_filename.startswith(root):
                    caller = re.split(
                        r"site-packages/|/lib/python3\.\d+/", back.f_code.co_filename
                    )[-1]
                    entries[f"{caller}:{back.f_code.co_name} -> {here}"] += 1

    class Watch(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == args.warmup:
                armed.append(True)
                sys.setprofile(profile)

        def on_train_batch_end(self, batch, logs=None):
            armed.clear()
            sys.setprofile(None)

    # dynamo's C frame hook drops the profile function where a compiled function
    # runs: off while dynamo's hook is on, on again when it comes off.
    from torch._dynamo import eval_frame

    def rearmed(original):
        def set_hook(callback, *a, **k):
            if armed and callback is not None:
                sys.setprofile(None)  # on inside a compiled call, dynamo recompiles
            result = original(callback, *a, **k)
            if armed and callback is None and result is not None:
                sys.setprofile(profile)
            return result

        return set_hook

    for name in ("set_eval_frame", "_maybe_set_eval_frame"):
        setattr(eval_frame, name, rearmed(getattr(eval_frame, name)))
    model.fit(
        tokens,
        np.roll(tokens, -1, axis=1),
        batch_size=4,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[Watch()],
    )
    if int(os.environ.get("RANK", "0")) == 0:
        result = {
            "package": root,
            "files": dict(sorted(calls.items())),
            "functions": dict(sorted(functions.items())),
            "entries": dict(sorted(entries.items())),
        }
        Path(args.out).write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--seq", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2, help="1: one process")
    parser.add_argument("--src", help="import the plugin from this src folder")
    parser.add_argument("--json", help="write the result here too")
    parser.add_argument("--functions", action="store_true", help="name them too")
    parser.add_argument("--entries", action="store_true", help="calls from outside")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    out = Path(tempfile.mkdtemp()) / "files.json"
    one = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}
    env = {
        **os.environ,
        "KERAS_BACKEND": "torch",
        "OMP_NUM_THREADS": "1",
        "KERAS_DTENSOR_FIX_COMPILE": "blocks",
    }
    if args.src:
        env["PYTHONPATH"] = os.pathsep.join(
            [args.src, *filter(None, [env.get("PYTHONPATH")])]
        )
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    if args.ranks == 1:
        env.update(one, LOCAL_RANK="0", MASTER_PORT=str(29500 + os.getpid() % 500))
        launch = [sys.executable]
    command = [
        *launch, *([f"--nproc_per_node={args.ranks}"] * (args.ranks > 1)),
        __file__, "--worker", f"--out={out}",
        f"--layers={args.layers}", f"--hidden={args.hidden}",
        f"--seq={args.seq}", f"--warmup={args.warmup}",
    ]  # fmt: skip
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0 or not out.exists():
        sys.exit(f"failed:\n{proc.stderr[-3000:]}")
    result = json.loads(out.read_text())
    files = result["files"]
    print(f"{result['package']}: {len(files)} files in one steady step")
    for name, count in files.items():
        print(f"  {name}: {count} calls")
        if args.functions:
            for where, n in result["functions"].items():
                if where.startswith(f"{name}:"):
                    print(f"      {where.split(':', 1)[1]}: {n}")
    if args.entries:
        print(f"{len(result['entries'])} hand-backs (caller -> plugin function: calls)")
        for where, n in result["entries"].items():
            print(f"  {where}: {n}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
