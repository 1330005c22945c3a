"""Unfixable DTensor mixes on two ranks, for ``test_errors.py``.

Run as ``torch.distributed.run --nproc_per_node=2 errors.py OUT_DIR``. Each
rank writes ``OUT_DIR/rank<R>.json``: for every case, the type and message of
the error it raised and of its ``__cause__`` (or ``"no error"``).
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path

import keras
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from keras_dtensor_fix.engine import state


class AddOffset(keras.layers.Layer):
    """Adds a plain tensor shaped like this rank's shard of its input."""

    def build(self, input_shape):
        pass

    def call(self, x):
        return keras.ops.add(x, torch.ones_like(x.to_local()))


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.proj = keras.layers.Dense(8, name="proj")
        self.offset = AddOffset(name="add_offset")

    def build(self, input_shape):
        pass

    def call(self, x):
        return self.offset(self.proj(x))


def outcome(fn) -> dict:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        cause = exc.__cause__
        return {
            "type": type(exc).__name__,
            "message": str(exc),
            "cause_type": type(cause).__name__ if cause is not None else None,
            "cause": str(cause) if cause is not None else None,
        }
    return {"type": "no error"}


def main(out: Path) -> int:
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state.note_sharding()
    x = distribute_tensor(torch.arange(32.0).reshape(4, 8), mesh, [Shard(1)])
    results = {
        # One rank's (4, 4) shard of a (4, 8) value, taken for the full value.
        "per_rank_shard": outcome(lambda: keras.ops.add(x, torch.ones(4, 4))),
        # A shape that fits neither the global nor the local shape.
        "matmul_shapes": outcome(lambda: keras.ops.matmul(torch.ones(3, 5), x)),
    }
    devices = keras.distribution.list_devices()
    device_mesh = keras.distribution.DeviceMesh((world,), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*proj/kernel"] = (None, "model")
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        block = Block(name="block")
        inputs = torch.ones(3, 4)
        results["layer_filtered"] = outcome(lambda: block(inputs))
        keras.config.disable_traceback_filtering()
        try:
            results["layer_unfiltered"] = outcome(lambda: block(inputs))
        finally:
            keras.config.enable_traceback_filtering()
        kernel = block.proj.kernel.value
        results["kernel"] = {
            "type": type(kernel).__name__,
            "placements": [str(p) for p in getattr(kernel, "placements", ())],
        }
    results["shard"] = str(Shard(1))
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import leave  # skips a teardown that can abort: see leave()

    leave(main(Path(sys.argv[1])))
