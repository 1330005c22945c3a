"""What one benchmark rank runs, for ``bench.py``: the models (Keras, and the
plain PyTorch tensor-parallel reference), their train steps, and the
measurements (step times, alternating blocks, collectives, Python calls).

``tests/ranks/collectives.py`` and ``hub*.py`` count collectives with
:func:`collectives` too.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time

BATCH = 32


def collectives(step, steps: int = 3) -> float:
    """Collectives per step, counted as c10d / gloo / nccl events."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            step()
    return collective_events(p) / steps


def collective_events(profile) -> int:
    """The collectives a finished ``torch.profiler.profile`` saw (barriers not)."""
    names = [e.name for e in profile.events()]
    return sum(
        1 for n in names if n.startswith("c10d::") and not n.startswith("c10d::barrier")
    )


def _alternate(sides, warmup: int, steps: int, blocks: int = 20):
    """Step times of two sides in alternating blocks of one process (per rank).

    ``sides`` is two ``(enter, step)`` pairs: ``enter()`` runs before each of
    that side's blocks. Free of the variance between processes: ``single-ab``
    switches the plugin on and off (``deactivate()`` restores Keras's own
    functions), ``tp-ab`` runs the Keras model and the PyTorch reference in
    the same two ranks. Returns both sides' times and, per pair of
    neighbouring blocks, the log of side a's block median over side b's:
    their mean and spread say how far the ratio can be trusted here.
    """
    times: tuple[list[float], list[float]] = ([], [])
    pairs: list[float] = []
    for block in range(blocks):
        medians = [0.0, 0.0]
        for side in (0, 1) if block % 2 == 0 else (1, 0):
            enter, step = sides[side]
            enter()
            block_times = _time(step, warmup, steps)
            times[side].extend(block_times)
            medians[side] = statistics.median(block_times)
        pairs.append(math.log(medians[0] / medians[1]))
    return times[0], times[1], pairs


def extra_calls(step) -> tuple[int, int]:
    """Python calls of one step with the plugin on, and how many more than off.

    Counted with ``sys.setprofile`` (function and builtin calls): a figure that
    no noise moves, for what the wrappers' fast path adds to a step.
    """
    import keras_dtensor_fix

    def count() -> int:
        calls = [0]

        def profile(frame, event, arg):
            if event in ("call", "c_call"):
                calls[0] += 1

        step()
        sys.setprofile(profile)
        try:
            step()
        finally:
            sys.setprofile(None)
        return calls[0]

    keras_dtensor_fix.deactivate()
    off = count()
    keras_dtensor_fix.activate()
    on = count()
    return on, on - off


def _time(step, warmup: int, steps: int) -> list[float]:
    import torch

    sync = torch.cuda.synchronize if _device() == "cuda" else lambda: None
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _device() -> str:
    """``cuda`` or ``cpu``, as the driver chose (``--device``)."""
    return os.environ.get("BENCH_DEVICE", "cpu")


def _init_distributed() -> str | None:
    """Start the process group before Keras or the reference does; its backend.

    On CUDA each rank takes GPU ``local_rank % count``. NCCL refuses two ranks
    on one GPU, so with fewer GPUs than ranks the ranks share them over gloo
    (CUDA tensors; gloo stages them through host memory).
    """
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    backend = "gloo"
    if _device() == "cuda":
        count = torch.cuda.device_count()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % count)
        backend = "nccl" if count >= world else "gloo"
    dist.init_process_group(backend)
    return backend


def _keras_step(model_name: str, config: str):
    import keras
    import numpy as np

    from keras_dtensor_fix.demo import set_model_parallel

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        # Keras names one device per rank; on a GPU shared by the ranks
        # list_devices() would name only the one GPU.
        kind = "gpu" if _device() == "cuda" else "cpu"
        set_model_parallel(LAYOUTS[model_name], [f"{kind}:{r}" for r in range(world)])
    keras.utils.set_random_seed(0)
    model, x, y = KERAS_MODELS[model_name](np, keras)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss="mse",
        jit_compile=config == "compiled",
    )

    def step():
        model.train_on_batch(x, y)

    return step


def _keras_mlp(np, keras):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 64)).astype("float32")
    y = rng.normal(size=(BATCH, 8)).astype("float32")
    model = keras.Sequential(
        [
            keras.layers.Input((64,)),
            keras.layers.Dense(1024, activation="relu", name="fc1"),
            keras.layers.Dense(8, name="fc2"),
        ]
    )
    return model, x, y


SEQ, DIM, HEADS, FFN = 16, 64, 4, 256


def _keras_transformer(np, keras):
    from keras import layers

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, SEQ, DIM)).astype("float32")
    y = rng.normal(size=(BATCH, SEQ, DIM)).astype("float32")
    inputs = layers.Input((SEQ, DIM))
    attention = layers.MultiHeadAttention(HEADS, DIM // HEADS, name="mha")(
        inputs, inputs
    )
    h = layers.LayerNormalization(name="ln_1")(inputs + attention)
    f = layers.Dense(FFN, activation="relu", name="ffn_1")(h)
    out = layers.LayerNormalization(name="ln_2")(h + layers.Dense(DIM, name="ffn_2")(f))
    return keras.Model(inputs, out), x, y


KERAS_MODELS = {"mlp": _keras_mlp, "transformer": _keras_transformer}
LAYOUTS = {
    "mlp": {
        ".*fc1/kernel": (None, "model"),
        ".*fc1/bias": ("model",),
        ".*fc2/kernel": ("model", None),
    },
    "transformer": {
        ".*mha/(query|key|value)/kernel": (None, "model", None),
        ".*mha/(query|key|value)/bias": ("model", None),
        ".*mha/attention_output/kernel": ("model", None, None),
        ".*ffn_1/kernel": (None, "model"),
        ".*ffn_1/bias": ("model",),
        ".*ffn_2/kernel": ("model", None),
    },
}


def _torch_tp_step(model_name: str):
    """The same model in plain PyTorch tensor parallel (Megatron style)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    world = dist.get_world_size()
    device = _device()
    mesh = init_device_mesh(device, (world,))
    torch.manual_seed(0)
    # Built on ``device`` explicitly: torch.set_default_device() would push a
    # TorchFunctionMode that turns every torch call into a Python call.
    dev = {"device": device}

    if model_name == "mlp":
        model = nn.Sequential(
            nn.Linear(64, 1024, **dev), nn.ReLU(), nn.Linear(1024, 8, **dev)
        )
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
        x, y = torch.randn(BATCH, 64, **dev), torch.randn(BATCH, 8, **dev)
    else:

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.q, self.k, self.v = (nn.Linear(DIM, DIM, **dev) for _ in range(3))
                self.o = nn.Linear(DIM, DIM, **dev)
                self.ln1, self.ln2 = nn.LayerNorm(DIM, **dev), nn.LayerNorm(DIM, **dev)
                self.f1 = nn.Linear(DIM, FFN, **dev)
                self.f2 = nn.Linear(FFN, DIM, **dev)

            def forward(self, x):
                b, s, _ = x.shape
                heads = HEADS // world

                def split(t):
                    return t.view(b, s, heads, -1).transpose(1, 2)

                q, k, v = split(self.q(x)), split(self.k(x)), split(self.v(x))
                a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
                a = a.transpose(1, 2).reshape(b, s, -1)
                h = self.ln1(x + self.o(a))
                return self.ln2(h + self.f2(torch.relu(self.f1(h))))

        model = Block()
        plan = {
            "q": ColwiseParallel(),
            "k": ColwiseParallel(),
            "v": ColwiseParallel(),
            "o": RowwiseParallel(),
            "f1": ColwiseParallel(),
            "f2": RowwiseParallel(),
        }
        x = torch.randn(BATCH, SEQ, DIM, **dev)
        y = torch.randn(BATCH, SEQ, DIM, **dev)
    model = parallelize_module(model, mesh, plan)
    # Unparallelized parameters (LayerNorms) stay plain tensors; foreach ops
    # cannot mix them with DTensors, so each kind gets its own Adam.
    from torch.distributed.tensor import DTensor

    params = list(model.parameters())
    groups = [
        [p for p in params if isinstance(p, DTensor)],
        [p for p in params if not isinstance(p, DTensor)],
    ]
    optimizers = [
        torch.optim.Adam(group, lr=1e-3, foreach=True) for group in groups if group
    ]

    def step():
        for optimizer in optimizers:
            optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()

    return step
