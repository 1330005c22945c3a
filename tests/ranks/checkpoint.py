"""Sharded checkpoints on CPU ranks (or one process), for ``test_checkpoint.py``.

Run as ``torch.distributed.run --nproc_per_node=N checkpoint.py OUT [steps]``
or ``python checkpoint.py OUT [steps]``. ``CHECKPOINT_MESH`` ("1,2", "2,1",
"2,2") is the (batch, model) mesh of a distributed run. Each process writes
``OUT/rank<R>.json`` with one entry per step:

``--train``     an uninterrupted 4-epoch fit; a 2-epoch fit that saves with
                the ``Checkpoint`` callback to ``OUT/ckpt``; a fresh model
                resumed from it; the same without the optimizer state
``--resume D[@B,M]``  a fresh model resumed from checkpoint ``D`` (repeatable),
                on the mesh (B, M) when given (a distributed run only)
``--memory``    RSS high-water growth during a save of a large sharded model,
                and during ``get_weights()`` (a full gather), for scale
``--errors``    one process: bad inputs (the errors' types and messages), an
                integer ``save_freq``
``--metrics``   a metrics round trip (``metrics=True``)
``--crash``     save, then die (a forked child, ``os._exit``) halfway through a
                second save, after every shard is written and before the
                metadata; then load what is left and save again
``--upstream``  ``model.save_weights`` on every rank (run with the plugin off)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "multiprocess"))

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402
from scenario_kit import MEGATRON, RANK, WORLD, data, distribute  # noqa: E402

MESH = tuple(int(n) for n in os.environ.get("CHECKPOINT_MESH", "1,2").split(","))
#: The (batch, model) mesh in use.
current = MESH
SEED, BATCH, EPOCHS, SPLIT = 1234, 16, 4, 2
# Every sharded layout of the module: a column- then a row-parallel kernel.
LAYOUT = {
    **MEGATRON,
    ".*dense_3/kernel": (None, "model"),
    ".*big_.*/kernel": (None, "model"),
}


def use_mesh(shape: tuple[int, ...]) -> None:
    global current
    current = shape
    distribute(shape, LAYOUT)


def model(extra: bool = False, units: int = 32, metrics=None) -> keras.Model:
    """The MLP (with a seeded dropout: its state is checkpointed too), compiled."""
    stack = [
        layers.Input((16,)),
        layers.Dense(units, activation="relu", name="dense_1"),
        layers.Dropout(0.2, seed=7, name="drop"),
        layers.Dense(32, activation="relu", name="dense_2"),
        layers.Dense(4, name="dense_3"),
    ]
    if extra:
        stack.append(layers.Dense(4, name="dense_4"))
    net = keras.Sequential(stack)
    net.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", metrics=metrics)
    return net


def fit(net, epochs: int, initial_epoch: int = 0, callbacks=()) -> list[float]:
    """Fit on this process's rows of every batch (all rows off a batch axis)."""
    x, y = data()
    batch = BATCH
    if WORLD > 1 and current[0] > 1:
        # Rank r sits at (r // current[1], r % current[1]) of the mesh.
        part, parts = RANK // current[1], current[0]
        batch = BATCH // parts
        x, y = (a.reshape(-1, parts, batch, a.shape[1])[:, part] for a in (x, y))
        x, y = x.reshape(-1, 16), y.reshape(-1, 4)
    history = net.fit(
        x,
        y,
        batch_size=batch,
        epochs=epochs,
        initial_epoch=initial_epoch,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return [float(v) for v in history.history["loss"]]


def resume(directory: str, *, optimizer: bool = True) -> dict:
    """A fresh model loaded from ``directory``, trained to the last epoch."""
    from keras_dtensor_fix import checkpoint

    net = model()
    net.optimizer.build(net.trainable_variables)
    before = {v.path: (v._value, local(v).data_ptr()) for v in all_variables(net)}
    info = checkpoint.load(net, directory, optimizer=optimizer)
    in_place = all(
        v._value is before[v.path][0] and local(v).data_ptr() == before[v.path][1]
        for v in all_variables(net)
    )
    return {
        "info": info,
        "in_place": in_place,
        "placements": placements(net),
        "losses": fit(net, EPOCHS, initial_epoch=info["epoch"]),
    }


def resume_on(spec: str) -> dict:
    """``resume`` for ``DIR`` or ``DIR@B,M`` (on that mesh)."""
    directory, _, mesh = spec.partition("@")
    if mesh:
        use_mesh(tuple(int(n) for n in mesh.split(",")))
    return resume(directory)


def all_variables(net) -> list:
    return net.variables + net.optimizer.variables


def local(variable):
    value = variable._value
    return getattr(value, "_local_tensor", value)


def placements(net) -> dict:
    """The sharded variables' mesh, placements and local shape (after loading)."""
    return {
        v.path.split("/", 1)[1]: {
            "mesh": list(v._value.device_mesh.shape),
            "placements": [str(p) for p in v._value.placements],
            "local": list(local(v).shape),
        }
        for v in net.variables
        if any(p.is_shard() for p in getattr(v._value, "placements", ()))
    }


# ---------------------------------------------------------------- steps


def train(out: Path) -> dict:
    from keras_dtensor_fix.checkpoint import Checkpoint

    keras.utils.set_random_seed(SEED)
    reference = fit(model(), EPOCHS)
    keras.utils.set_random_seed(SEED)
    first = fit(model(), SPLIT, callbacks=[Checkpoint(out / "ckpt")])
    resumed = resume(str(out / "ckpt"))
    cold = resume(str(out / "ckpt"), optimizer=False)
    return {
        "reference": reference,
        "first": first,
        "resumed": resumed,
        "no_optimizer": cold["losses"],
        "listing": sorted(os.listdir(out / "ckpt")),
    }


def _rss(field: str) -> int:
    with open("/proc/self/status") as handle:
        return int(re.search(rf"{field}:\s+(\d+) kB", handle.read()).group(1)) * 1024


def peak_growth(fn) -> int:
    """Bytes the resident set grows by at most while ``fn`` runs.

    Writing 5 to clear_refs resets the high-water mark (VmHWM) to the current
    RSS (Linux). Large allocations are mmapped (the test sets
    ``MALLOC_MMAP_THRESHOLD_``), so freed memory is not reused unseen.
    """
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:  # OSError: not Linux
        handle.write("5")
    start = _rss("VmRSS")
    fn()
    return _rss("VmHWM") - start


def memory(out: Path) -> dict:
    """Peak RSS growth while saving a model of 8 column-sharded 4 MiB kernels."""
    from keras_dtensor_fix import checkpoint

    if not os.access("/proc/self/clear_refs", os.W_OK):
        return {"skipped": "no writable /proc/self/clear_refs (Linux only)"}
    keras.utils.set_random_seed(SEED)
    width, depth = 1024, 8
    net = keras.Sequential(
        [layers.Input((width,))]
        + [layers.Dense(width, name=f"big_{i}") for i in range(depth)]
    )
    sizes = [(v.value.numel() * 4, local(v).numel() * 4) for v in net.variables]
    # A warm-up save of a small model loads DCP's code first.
    checkpoint.save(model(), out / "warm", optimizer=False)
    saved = peak_growth(lambda: checkpoint.save(net, out / "big", optimizer=False))
    gathered = peak_growth(lambda: net.get_weights())
    return {
        "full_bytes": sum(full for full, _ in sizes),
        "shard_bytes": sum(shard for _, shard in sizes),
        "largest_variable": max(full for full, _ in sizes),
        "largest_shard": max(shard for _, shard in sizes),
        "save_growth": saved,
        "gather_growth": gathered,
    }


def outcome(fn) -> dict:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"type": type(exc).__name__, "message": str(exc)}
    return {"type": "no error"}


def errors(out: Path) -> dict:
    from keras_dtensor_fix import checkpoint

    good = out / "good"
    net = model()
    fit(net, 1, callbacks=[checkpoint.Checkpoint(good, save_freq=3)])
    info = checkpoint.load(model(), good)
    checkpoint.save(net, out / "no_opt", optimizer=False)
    os.makedirs(out / "empty")
    return {
        "int_save_freq": {"epoch": info["epoch"], "step": info["step"]},
        "extra_layer": outcome(lambda: checkpoint.load(model(extra=True), good)),
        "missing_layer": outcome(lambda: _load_smaller(good)),
        "shape": outcome(lambda: checkpoint.load(model(units=24), good)),
        "no_directory": outcome(lambda: checkpoint.load(model(), out / "nope")),
        "empty_directory": outcome(lambda: checkpoint.load(model(), out / "empty")),
        "no_optimizer_saved": outcome(lambda: checkpoint.load(model(), out / "no_opt")),
        "bad_save_freq": outcome(lambda: checkpoint.Checkpoint(good, save_freq=0)),
        "unbuilt": outcome(lambda: checkpoint.save(keras.Sequential(), out / "x")),
    }


def metrics_round_trip(directory: Path) -> dict:
    """metrics=True: a model's metric state comes back into another's."""
    from keras_dtensor_fix import checkpoint

    def values(net):
        return [np.asarray(v).tolist() for v in net.metrics_variables]

    saved, other = model(metrics=["mae"]), model(metrics=["mae"])
    fit(saved, 1)
    fit(other, 2)
    checkpoint.save(saved, directory, metrics=True)
    before = values(other)
    checkpoint.load(other, directory, metrics=True)
    return {
        "count": len(before),
        "differed": before != values(saved),
        "equal": values(other) == values(saved),
    }


def _load_smaller(directory: Path) -> None:
    """A model without dense_3: the checkpoint holds variables it lacks."""
    from keras_dtensor_fix import checkpoint

    net = keras.Sequential(
        [
            layers.Input((16,)),
            layers.Dense(32, name="dense_1"),
            layers.Dropout(0.2, seed=7, name="drop"),
            layers.Dense(32, name="dense_2"),
        ]
    )
    net.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    checkpoint.load(net, directory)


def weights(net) -> list:
    return [np.asarray(w, "float64").tolist() for w in net.get_weights()]


def crash(directory: Path) -> dict:
    """Save, die (a forked child) halfway through the next save, load, save."""
    import torch.distributed.checkpoint as dcp

    from keras_dtensor_fix import checkpoint

    net = model()
    fit(net, 1)
    checkpoint.save(net, directory)
    saved = weights(net)
    pid = os.fork()
    if pid == 0:  # the child trains on and dies in its save
        try:
            fit(net, 1)

            def die(*args, **kwargs):
                os._exit(17)  # every shard is written; the metadata is not

            dcp.FileSystemWriter.finish = die
            checkpoint.save(net, directory)
        finally:
            os._exit(1)
    exit_code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    listing = sorted(os.listdir(directory))
    fresh = model()
    info = checkpoint.load(fresh, directory)
    same = all(np.array_equal(a, b) for a, b in zip(weights(fresh), saved, strict=True))
    checkpoint.save(fresh, directory)
    return {
        "exit_code": exit_code,
        "listing": listing,
        "step": info["step"],
        "same_weights": same,
        "listing_after_save": sorted(os.listdir(directory)),
    }


def upstream(out: Path) -> dict:
    """What Keras itself offers: ``save_weights``, per rank, then one shared path.

    A rank stuck in a collective for 20 s dumps its stack and exits.
    """
    import faulthandler

    keras.utils.set_random_seed(SEED)
    net = model()
    result = {"kernel_local_shape": list(local(net.get_layer("dense_1").kernel).shape)}
    own = out / f"rank{RANK}.weights.h5"
    result["own_path"] = outcome(lambda: net.save_weights(own))
    result["own_path_bytes"] = own.stat().st_size if own.exists() else None
    full = keras.Sequential(
        [layers.Input((16,))] + [layers.Dense(32 if i < 2 else 4) for i in range(3)]
    )
    full.set_weights(net.get_weights())
    plain = out / f"plain{RANK}.weights.h5"
    full.save_weights(plain)  # the same weights, unsharded, for scale
    result["unsharded_bytes"] = plain.stat().st_size
    (out / f"rank{RANK}.json").write_text(json.dumps({"upstream": result}))
    faulthandler.dump_traceback_later(20, exit=True)
    shared = out / "shared.weights.h5"
    result["shared_path"] = outcome(lambda: net.save_weights(shared))
    faulthandler.cancel_dump_traceback_later()
    return result


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--train", action="store_true")
    parser.add_argument("--resume", action="append", default=[])
    parser.add_argument("--memory", action="store_true")
    parser.add_argument("--errors", action="store_true")
    parser.add_argument("--metrics", action="store_true")
    parser.add_argument("--crash", action="store_true")
    parser.add_argument("--upstream", action="store_true")
    args = parser.parse_args()
    keras.config.disable_traceback_filtering()
    if WORLD > 1:
        keras.distribution.initialize()
    use_mesh(MESH)
    args.out.mkdir(parents=True, exist_ok=True)
    steps = {
        "train": (args.train, lambda: train(args.out)),
        "memory": (args.memory, lambda: memory(args.out)),
        "errors": (args.errors, lambda: errors(args.out)),
        "metrics": (args.metrics, lambda: metrics_round_trip(args.out / "metrics")),
        "crash": (args.crash, lambda: crash(args.out / "crash")),
        "upstream": (args.upstream, lambda: upstream(args.out)),
        # Last: it may switch the mesh.
        "resume": (args.resume, lambda: [resume_on(spec) for spec in args.resume]),
    }
    results = {}
    for name, (wanted, step) in steps.items():
        if not wanted:
            continue
        start = time.perf_counter()
        try:
            results[name] = step()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[name] = {"error": repr(exc), "traceback": traceback.format_exc()}
        results[f"{name}_seconds"] = time.perf_counter() - start
    (args.out / f"rank{RANK}.json").write_text(json.dumps(results))
    if WORLD > 1:
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import leave  # skips a teardown that can abort: see leave()

    leave(main())
