"""``model.save`` on process 0 only, for ``test_save_some.py``.

Run as ``torch.distributed.run --nproc_per_node=2 save_some.py OUT_DIR``.
Process 0 saves a ModelParallel model; process 1 does not (the data-parallel
habit ``if rank == 0: model.save(...)``), then every process saves. Each
writes ``OUT_DIR/rank<R>.json``: the first save's error (or "saved") and the
seconds it took, and whether the second, on every process, worked.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import keras
import torch.distributed as dist

out = Path(sys.argv[1])
keras.distribution.initialize()
rank = dist.get_rank()
devices = keras.distribution.list_devices()
mesh = keras.distribution.DeviceMesh((1, 2), ["batch", "model"], devices)
layout_map = keras.distribution.LayoutMap(mesh)
layout_map[".*hidden/kernel"] = (None, "model")
keras.distribution.set_distribution(
    keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
)
model = keras.Sequential(
    [
        keras.layers.Input((8,)),
        keras.layers.Dense(16, name="hidden"),
        keras.layers.Dense(2, name="out"),
    ]
)
if os.environ.get("KERAS_DTENSOR_FIX", "1") != "0":
    import keras_dtensor_fix.saving.handshake

    keras_dtensor_fix.saving.handshake.SECONDS = 5.0
result: dict = {}
start = time.monotonic()
if rank == 0:
    (out / "saving").touch()  # test_upstream_waits times the wait from here
    try:
        model.save(str(out / "only0.keras"))
        result["first"] = "saved"
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        result["first"] = f"{type(exc).__name__}: {exc}"
    result["seconds"] = time.monotonic() - start
dist.barrier()
model.save(str(out / f"every{rank}.keras"))
result["second"] = (out / f"every{rank}.keras").is_file()
(out / f"rank{rank}.json").write_text(json.dumps(result))
dist.barrier()
dist.destroy_process_group()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import leave  # noqa: E402  (skips a teardown that can abort: see leave())

leave(0)
