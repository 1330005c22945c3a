"""The keras-hub benchmark's models and its timed worker (``hub.py --worker``).

One process of a configuration: builds each case's model, fits it with the
configuration's plugin and distribution, times the steps and writes a JSON
row per case (see ``hub.py`` for the configurations and what is measured).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import bench  # noqa: E402  benchmarks/bench.py: _pin(), _reason(), leave()

CONFIGS = ("upstream", "eager", "compiled", "single", "single-off")
FOUR_CONFIGS = ("upstream4", "eager4")
PLANNED_CONFIGS = ("planned", "planned-compiled")  # --planned: auto_layout_map
AB_CONFIG = "single-ab"  # --ab: the cases with hidden <= 256
TWO_D_MESH = (2, 2)
VOCAB, SEQ, LAYERS, HEAD = 2048, 128, 4, 64
TITLES = {
    "gpt": "GPT decoder (keras_hub.layers)",
    "gemma": "GemmaCausalLM",
    "llama": "LlamaCausalLM",
}
GPT_LAYOUT = {  # Megatron: column-parallel Q/K/V and FFN in, row-parallel out
    r".*self_attention/(query|key|value)/kernel": (None, "model", None),
    r".*self_attention/(query|key|value)/bias": ("model", None),
    r".*self_attention/attention_output/kernel": ("model", None, None),
    r".*feedforward_intermediate_dense/kernel": (None, "model"),
    r".*feedforward_intermediate_dense/bias": ("model",),
    r".*feedforward_output_dense/kernel": ("model", None),
    r".*lm_head/kernel": (None, "model"),
    r".*lm_head/bias": ("model",),
}


# ---------------------------------------------------------------- models


def build(kind: str, hidden: int, layers: int, seq: int):
    import keras
    import keras_hub

    heads = max(2, hidden // HEAD)
    if kind == "gpt":
        ids = keras.Input((seq,), dtype="int32", name="token_ids")
        mask = keras.Input((seq,), dtype="int32", name="padding_mask")
        x = keras_hub.layers.TokenAndPositionEmbedding(
            VOCAB, seq, hidden, name="embedding"
        )(ids)
        for i in range(layers):
            x = keras_hub.layers.TransformerDecoder(
                4 * hidden, heads, name=f"decoder_{i}"
            )(x, decoder_padding_mask=mask)
        logits = keras.layers.Dense(VOCAB, name="lm_head")(x)
        model = keras.Model({"token_ids": ids, "padding_mask": mask}, logits)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
        return model
    common = dict(
        vocabulary_size=VOCAB,
        num_layers=layers,
        num_query_heads=heads,
        num_key_value_heads=max(2, heads // 2),
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
    )
    if kind == "gemma":
        backbone = keras_hub.models.GemmaBackbone(head_dim=HEAD, **common)
        model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(**common)
        model = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    # keras-hub's defaults (loss, weighted accuracy), as a user compiles it.
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    return model


def layout_map(kind: str, mesh, planned: tuple | None = None):
    """The case's own map, or with ``planned=(hidden, layers, seq)`` the one
    ``keras_dtensor_fix.auto_layout_map`` plans from the model users fit."""
    import keras
    import keras_hub

    if planned:
        import keras_dtensor_fix

        return keras_dtensor_fix.auto_layout_map(lambda: build(kind, *planned), mesh)
    if kind == "gemma":
        return keras_hub.models.GemmaBackbone.get_layout_map(mesh)
    if kind == "llama":
        return keras_hub.models.LlamaBackbone.get_layout_map(mesh)
    layouts = keras.distribution.LayoutMap(mesh)  # keys: re.fullmatch regexes
    for key, axes in GPT_LAYOUT.items():
        layouts[key] = axes
    return layouts


# ---------------------------------------------------------------- worker

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


def _peak_reset() -> None:
    """Return freed heap to the OS (glibc), then reset the peak RSS to now."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)
    except OSError:
        pass


def _peak_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def distribute(kind: str, mesh_shape: tuple[int, int], planned: tuple | None = None):
    """Set the case's ModelParallel (none on one process); its layout map."""
    import keras

    keras.distribution.set_distribution(None)
    if WORLD == 1:
        return None
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
    layouts = layout_map(kind, mesh, planned)
    dist = keras.distribution.ModelParallel(layout_map=layouts, batch_dim_name="batch")
    dist.auto_shard_dataset = False  # numpy input: every rank feeds its rows
    keras.distribution.set_distribution(dist)
    return layouts


def layout_diff(model, own, planned) -> list[str]:
    """Each weight whose resolved layout differs between the two maps."""

    def axes(layouts, variable) -> tuple:
        layout = layouts[variable.path]  # as ModelParallel resolves it
        return tuple(layout.axes) if layout else (None,) * len(variable.shape)

    return [
        f"{v.path} {tuple(v.shape)}: own {axes(own, v)}, planned {axes(planned, v)}"
        for v in model.weights
        if axes(own, v) != axes(planned, v)
    ]


def case_data(batch: int, steps: int, seq: int, batch_ranks: int):
    """Token ids and labels for ``steps`` global batches; this rank's rows."""
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(1, VOCAB, size=(batch * steps, seq + 1)).astype("int32")
    x = {"token_ids": ids[:, :-1], "padding_mask": np.ones((len(ids), seq), "int32")}
    y = ids[:, 1:]
    if batch_ranks > 1:
        index, per = RANK // (WORLD // batch_ranks), batch // batch_ranks

        def rows(a):
            return a.reshape(steps, batch_ranks, per, *a.shape[1:])[:, index].reshape(
                -1, *a.shape[1:]
            )

        x, y = {k: rows(v) for k, v in x.items()}, rows(y)
    return x, y, batch // batch_ranks


def run_case(case: str, config: str, args) -> dict:
    import gc
    import warnings

    import keras
    import torch

    kind, hidden = case.split(":")
    mesh_shape = TWO_D_MESH if WORLD == 4 else (1, WORLD)
    gc.collect()
    _peak_reset()
    planned = config.startswith("planned")
    compiled = config in ("compiled", "planned-compiled")
    shape = (int(hidden), args.layers, args.seq) if planned else None
    layouts = distribute(kind, mesh_shape, shape)
    keras.utils.set_random_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build(kind, int(hidden), args.layers, args.seq)
    compared = {}
    if planned and layouts is not None:  # same kernels split the same way?
        own = layout_map(kind, layouts.device_mesh)
        compared = {
            "layout_diff": layout_diff(model, own, layouts),
            "layout_weights": len(model.weights),
            "plan": layouts.plan.summary() if hasattr(layouts, "plan") else "",
        }
    if compiled:
        model.jit_compile = True  # as compile(jit_compile=True) sets it
    profile_steps = 2 if WORLD > 1 else 0
    total = args.warmup + args.steps + profile_steps
    batch_ranks = mesh_shape[0] if WORLD > 1 else 1
    x, y, per_rank = case_data(args.batch, total, args.seq, batch_ranks)
    stamps: list[float] = []
    profile: dict = {}

    class Clock(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if profile_steps and batch == args.warmup + args.steps:
                profile["p"] = torch.profiler.profile(
                    activities=[torch.profiler.ProfilerActivity.CPU]
                )
                profile["p"].__enter__()

        def on_train_batch_end(self, batch, logs=None):
            if "p" in profile:
                return
            stamps.append(time.perf_counter())

    if config in ("single-ab", "eager-ab"):
        switch = _switch(config)
        return _single_ab(model, x, y, per_rank, stamps, Clock(), args, switch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(
            x,
            y,
            batch_size=per_rank,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[Clock()],
        )
    if "p" in profile:
        profile["p"].__exit__(None, None, None)
        names = [e.name for e in profile["p"].events()]
        per_step = (
            sum(1 for n in names if n.startswith("c10d::") and "barrier" not in n)
            / profile_steps
        )
        # DTensor's dispatch records each op it takes as "PythonSubclass".
        dispatched = sum(1 for n in names if n == "PythonSubclass") / profile_steps
    else:
        per_step = dispatched = 0.0
    times = [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)]
    times = times[args.warmup - 1 :]
    counters = torch._dynamo.utils.counters
    messages = [str(w.message) for w in caught]
    ran_eager = compiled and (
        any("eager" in m or "Running without" in m for m in messages)
        or counters["stats"].get("unique_graphs", 0) == 0
    )
    result = {
        "ms": statistics.median(times),
        "times": times,
        "collectives": per_step,
        "dtensor_ops": dispatched,
        "graphs": counters["stats"].get("unique_graphs", 0),
        "breaks": sum(counters["graph_break"].values()),
        "ran_eager": ran_eager,
        "warnings": sorted({m[:160] for m in messages if "eager" in m})[:3],
        "peak_mb": _peak_mb(),
        "params": model.count_params(),
        **compared,
    }
    del model
    keras.distribution.set_distribution(None)
    return result


def fit_rows(model, x: dict, y, rows: slice, batch: int, callbacks=None) -> None:
    """``model.fit`` on ``rows`` of the token-id inputs ``x`` and labels ``y``,
    in order, one epoch, silent."""
    model.fit(
        {k: v[rows] for k, v in x.items()},
        y[rows],
        batch_size=batch,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


def _switch(config: str):
    """What ``config``'s A/B turns on and off: the plugin (``single-ab``) or
    the leaves family's local path (``eager-ab``; while its re-entry guard is
    set, every layer call runs Keras's own)."""
    import keras_dtensor_fix

    if config == "eager-ab":
        from keras_dtensor_fix.patches import leaves

        def switch(on: bool) -> None:
            leaves._ACTIVE[:] = [] if on else [True]

        return switch
    return lambda on: (
        keras_dtensor_fix.activate if on else keras_dtensor_fix.deactivate
    )()


def _single_ab(
    model, x, y, batch, stamps, clock, args, switch, blocks: int = 10
) -> dict:
    """``switch(on)`` on and off in alternating blocks of ``fit()`` steps in
    the same processes; per pair of neighbouring blocks the log of the on/off
    ratio of block medians (free of the variance between processes)."""
    import math

    def block(steps: int) -> list[float]:
        stamps.clear()
        fit_rows(model, x, y, slice(0, (steps + 1) * batch), batch, [clock])
        return [(b - a) * 1e3 for a, b in zip(stamps, stamps[1:], strict=False)]

    block(args.warmup)
    times: dict[bool, list[float]] = {True: [], False: []}
    pairs = []
    for index in range(blocks):
        medians = {}
        for on in (True, False) if index % 2 == 0 else (False, True):
            switch(on)
            block_times = block(args.steps)
            times[on] += block_times
            medians[on] = statistics.median(block_times)
        pairs.append(math.log(medians[True] / medians[False]))
    switch(True)
    return {
        "ms": statistics.median(times[True]),
        "times": times[True],
        "ms_off": statistics.median(times[False]),
        "times_off": times[False],
        "pairs": pairs,
        "collectives": 0.0,
        "graphs": 0,
        "breaks": 0,
        "peak_mb": _peak_mb(),
    }


def worker(config: str, cases: list[str], out: Path, args) -> None:
    os.environ.setdefault("KERAS_BACKEND", "torch")
    bench._pin()
    import torch

    torch.set_num_threads(1)
    if WORLD > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    import keras

    if WORLD > 1:
        keras.distribution.initialize()
    results: dict = {}
    for case in cases:
        try:
            results[case] = run_case(case, config, args)
        except Exception as err:  # reported per case; the others still run
            results[case] = {"error": f"{type(err).__name__}: {err}"[:400]}
        if WORLD > 1:  # every rank's peak memory; rank 0 writes
            import torch.distributed as dist

            peaks: list = [None] * WORLD
            dist.all_gather_object(peaks, results[case].get("peak_mb"))
            if "error" not in results[case]:
                results[case]["peak_mb_ranks"] = peaks
        if RANK == 0:
            out.write_text(json.dumps(results))
    if WORLD > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
