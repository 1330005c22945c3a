"""ModelParallel ``model.fit()`` speed on the models users run (keras-hub).

Models, random weights, no download, fed ``{"token_ids", "padding_mask"}``:

  gpt     TokenAndPositionEmbedding + TransformerDecoder blocks (keras_hub.layers)
          + a Dense head, with a Megatron-style LayoutMap written here
  gemma   GemmaCausalLM(preprocessor=None), GemmaBackbone.get_layout_map(mesh)
  llama   LlamaCausalLM(preprocessor=None), LlamaBackbone.get_layout_map(mesh)

each at several widths (``--sizes``; ``--sweep`` adds GPT widths for the
plot), 4 layers, sequence 128, head size 64, FFN 4x, vocabulary 2048, Adam,
the global batch (``--batch``) fed whole to every rank of a (1, N) mesh and
split by rows over the batch axis of a (2, 2) mesh. Configurations, each its
own processes, interleaved over ``--rounds``:

  upstream    Keras ModelParallel as shipped (KERAS_DTENSOR_FIX=0), 2 ranks
  eager       the plugin, 2 ranks
  compiled    the plugin, jit_compile=True, 2 ranks (models with keras-hub
              layers run eagerly, with a warning: reported as ran-eager)
  single      one process, no distribution, plugin on; single-off: plugin off
  eager-noleaves  eager with the ``leaves`` family off (not in the default
              set): what layers on local tensors change, in the same run;
              eager-ab: 2 ranks switching the leaves family's local path on
              and off in alternating blocks of steps (as single-ab does)
  eager4, upstream4   4 ranks on a (2, 2) mesh (``--four``; slow on 2 cores)

Every process uses one thread (torch.set_num_threads(1)), so a 2-rank step
compares with one process's one-thread step on the same global batch. Step
times come from a Callback (time between consecutive ``on_train_batch_end``
of one ``fit()``), the first ``--warmup`` steps (build, compile) left out.
Prints ms/step, tokens/s, ratios paired by round with a bootstrap interval,
collectives and DTensor-dispatched ops per step (c10d and ``PythonSubclass``
events in torch's profiler, after the timed steps), dynamo graphs and breaks,
peak RSS per rank (VmHWM, reset per case); writes a JSON, a log and, with
``--plot``, ms/step against width (PNG).

    python benchmarks/hub.py [--rounds 2] [--four] [--plot results/x.png]
    nox -s bench -- --models hub [hub.py arguments]
    python benchmarks/hub.py --profile gpt:512   # phases + plugin hot spots
    python benchmarks/hub.py --profile gpt:512 --kinds  # eager vs compiled, by kind
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import bench  # noqa: E402  benchmarks/bench.py: collectives(), _pin(), _reason()

CONFIGS = ("upstream", "eager", "compiled", "single", "single-off")
FOUR_CONFIGS = ("upstream4", "eager4")
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


def layout_map(kind: str, mesh):
    import keras
    import keras_hub

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


def _distribute(kind: str, mesh_shape: tuple[int, int]) -> None:
    import keras

    keras.distribution.set_distribution(None)
    if WORLD == 1:
        return
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
    dist = keras.distribution.ModelParallel(
        layout_map=layout_map(kind, mesh), batch_dim_name="batch"
    )
    dist.auto_shard_dataset = False  # numpy input: every rank feeds its rows
    keras.distribution.set_distribution(dist)


def _data(batch: int, steps: int, seq: int, batch_ranks: int):
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
    _distribute(kind, mesh_shape)
    keras.utils.set_random_seed(0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = build(kind, int(hidden), args.layers, args.seq)
    if config == "compiled":
        model.jit_compile = True  # as compile(jit_compile=True) sets it
    profile_steps = 2 if WORLD > 1 else 0
    total = args.warmup + args.steps + profile_steps
    batch_ranks = mesh_shape[0] if WORLD > 1 else 1
    x, y, per_rank = _data(args.batch, total, args.seq, batch_ranks)
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
    ran_eager = config == "compiled" and (
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
    }
    del model
    keras.distribution.set_distribution(None)
    return result


def _fit_rows(model, x: dict, y, rows: slice, batch: int, callbacks=None) -> None:
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
        _fit_rows(model, x, y, slice(0, (steps + 1) * batch), batch, [clock])
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


def profile_worker(case: str, args) -> None:
    """Rank 0: wall time per phase of an eager step, then cProfile's hot spots."""
    import cProfile
    import pstats

    os.environ.setdefault("KERAS_BACKEND", "torch")
    bench._pin()
    import torch

    torch.set_num_threads(1)
    if WORLD > 1:
        torch.distributed.init_process_group("gloo")
    import keras

    if WORLD > 1:
        keras.distribution.initialize()
    kind, hidden = case.split(":")
    _distribute(kind, (1, WORLD))
    keras.utils.set_random_seed(0)
    model = build(kind, int(hidden), args.layers, args.seq)
    phases = {"forward": 0.0, "loss": 0.0, "backward": 0.0, "optimizer": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[name] += time.perf_counter() - start

        return wrapper

    object.__setattr__(model, "call", timed("forward", model.call))
    object.__setattr__(model, "compute_loss", timed("loss", model.compute_loss))
    backward = torch.Tensor.backward
    torch.Tensor.backward = timed("backward", backward)
    opt = model.optimizer
    object.__setattr__(opt, "apply", timed("optimizer", opt.apply))
    steps = args.steps
    x, y, per_rank = _data(args.batch, args.warmup + 2 * steps + 2, args.seq, 1)

    def fit(n: int, offset: int) -> float:
        part = slice(offset * per_rank, (offset + n) * per_rank)
        start = time.perf_counter()
        _fit_rows(model, x, y, part, per_rank)
        return time.perf_counter() - start

    fit(args.warmup, 0)
    for name in phases:
        phases[name] = 0.0
    wall = fit(steps, args.warmup)
    measured = dict(phases)
    torch.Tensor.backward = backward
    profiler = cProfile.Profile()
    profiler.enable()
    prof_wall = fit(steps, args.warmup + steps)
    profiler.disable()
    if RANK == 0:
        print(f"== {case}, {WORLD} rank(s), {steps} steps, {1e3 * wall / steps:.1f} ms")
        for name, seconds in measured.items():
            share = seconds / wall
            print(f"  {name:10s} {1e3 * seconds / steps:8.1f} ms  {share:5.1%}")
        rest = wall - sum(measured.values())
        print(f"  {'rest':10s} {1e3 * rest / steps:8.1f} ms  {rest / wall:5.1%}")
        stats = pstats.Stats(profiler)
        rows = []
        groups: dict[str, float] = {}
        for (path, line, func), (_, _, tottime, cumtime, _) in stats.stats.items():
            group = _group(path)
            groups[group] = groups.get(group, 0.0) + tottime
            if "keras_dtensor_fix" in path:
                short = path.split("keras_dtensor_fix/")[-1]
                rows.append((cumtime, tottime, f"{short}:{line}:{func}"))
        print(f"  cProfile: {1e3 * prof_wall / steps:.1f} ms/step under the profiler")
        print("  self time by code (share of profiled wall time):")
        for group, seconds in sorted(groups.items(), key=lambda g: -g[1])[:8]:
            print(f"    {group:34s} {seconds / prof_wall:6.1%}")
        print("  plugin functions by cumulative time (cum %, self %):")
        for cum, tot, name in sorted(rows, reverse=True)[:25]:
            print(f"    {cum / prof_wall:6.1%} {tot / prof_wall:6.1%}  {name}")
        _callers(stats, steps)
    if WORLD > 1:
        _collective_sources(fit, args.warmup + 2 * steps)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


#: Where a profiled op's self time goes, first match wins (``--kinds``).
KINDS = (
    ("collectives (calls, waits)", ("c10d", "gloo", "plugin all-reduce wait")),
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "mkldnn")),
    ("attention", ("scaled_dot_product", "aten::_softmax")),
    ("fused (inductor)", ("cpp_fused", "kernel_cpp")),
    ("optimizer (foreach)", ("aten::_foreach",)),
    ("other aten ops", ("aten::",)),
)


def _kind(name: str) -> str:
    for kind, parts in KINDS:
        if any(part in name for part in parts):
            return kind
    return "other recorded"


def kinds_worker(case: str, args) -> None:
    """Eager and compiled steps of one model in the same processes, each
    profiled with torch's profiler: where rank 0's step time goes by kind of
    work (op self time), the rest being Python outside any op (Keras, the
    plugin, DTensor's dispatch, autograd's engine), and the collectives by
    name."""
    import collections

    os.environ.setdefault("KERAS_BACKEND", "torch")
    bench._pin()
    import torch
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # fused kernels by name
    torch.set_num_threads(1)
    if WORLD > 1:
        torch.distributed.init_process_group("gloo")
    import keras

    from keras_dtensor_fix.dtensor import collectives

    poll = collectives._poll

    def recorded_poll(work):  # the plugin's eager all-reduce waits, as an op
        with torch.profiler.record_function("plugin all-reduce wait"):
            return poll(work)

    collectives._poll = recorded_poll  # where _reduce_in_place looks it up
    if WORLD > 1:
        keras.distribution.initialize()
    kind, hidden = case.split(":")
    steps = args.steps
    rows = {}
    for config in ("eager", "compiled"):
        _distribute(kind, (1, WORLD))
        keras.utils.set_random_seed(0)
        torch._dynamo.reset()
        model = build(kind, int(hidden), args.layers, args.seq)
        model.jit_compile = config == "compiled"
        x, y, per_rank = _data(args.batch, args.warmup + steps, args.seq, 1)

        _fit_rows(model, x, y, slice(0, args.warmup * per_rank), per_rank)
        timed = slice(args.warmup * per_rank, (args.warmup + steps) * per_rank)
        start = time.perf_counter()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        ) as prof:
            _fit_rows(model, x, y, timed, per_rank)
        wall = (time.perf_counter() - start) * 1e3 / steps
        events = prof.events()
        # The step's thread: the one running the matmuls (gloo's own threads
        # run the collectives' transport concurrently and are counted apart).
        busy: collections.Counter = collections.Counter()
        for event in events:
            busy[event.thread] += event.name.startswith("aten::")
        main = busy.most_common(1)[0][0]
        by_kind: collections.Counter = collections.Counter()
        collectives: collections.Counter = collections.Counter()
        for event in events:
            if event.name.startswith("gloo:"):  # one per collective
                collectives[event.name] += 1 / steps
            if event.thread == main:
                by_kind[_kind(event.name)] += event.self_cpu_time_total / 1e3 / steps
        rows[config] = (wall, by_kind, collectives)
        del model
        keras.distribution.set_distribution(None)
    if RANK == 0:
        print(f"== {case}, {WORLD} rank(s), {steps} profiled steps, ms per step")
        print(f"  {'':26s} {'eager':>9s} {'compiled':>9s}")
        names = [k for k, _ in KINDS] + ["other recorded"]
        for name in names:
            cells = [rows[c][1].get(name, 0.0) for c in rows]
            print(f"  {name:26s} " + " ".join(f"{v:9.1f}" for v in cells))
        outside = [rows[c][0] - sum(rows[c][1].values()) for c in rows]
        print(
            f"  {'outside any op (Python)':26s} "
            + " ".join(f"{v:9.1f}" for v in outside)
        )
        print(
            f"  {'step (wall, profiled)':26s} "
            + " ".join(f"{rows[c][0]:9.1f}" for c in rows)
        )
        for config, (_, _, collectives) in rows.items():
            listed = ", ".join(f"{n} {c:.0f}" for n, c in collectives.most_common())
            print(f"  collectives per step, {config}: {listed}")
    if WORLD > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _callers(stats, steps: int) -> None:
    """Who issues the collectives: callers (two levels) of the plugin's
    all-reduce and of DTensor's redistribute, calls per step."""

    def short(key) -> str:
        path, line, func = key
        return f"{path.split('site-packages/')[-1].split('/src/')[-1]}:{line}:{func}"

    targets = [
        key
        for key in stats.stats
        if key[2] in ("all_reduce_sum", "redistribute")
        and ("keras_dtensor_fix" in key[0] or "distributed/tensor/_api" in key[0])
    ]
    for target in targets:
        callers = stats.stats[target][4]
        print(f"  callers of {short(target)} (calls per step):")
        for caller, info in sorted(callers.items(), key=lambda c: -c[1][1]):
            up = stats.stats.get(caller, (0, 0, 0, 0, {}))[4]
            above = sorted(up.items(), key=lambda c: -c[1][1])[:3]
            names = "; ".join(f"{short(k)} x{v[1] / steps:.1f}" for k, v in above)
            print(f"    {info[1] / steps:5.1f}  {short(caller)}  <- {names}")


def _collective_sources(fit, offset: int, steps: int = 2) -> None:
    """Collectives per step by kind and by where they are issued (rank 0)."""
    import collections

    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    dist = torch.distributed
    sizes: collections.Counter = collections.Counter()
    all_reduce = dist.all_reduce

    def counted(tensor, *args, group=None, **kwargs):  # the plugin's all-reduces
        sizes[dist.get_world_size(group)] += 1
        return all_reduce(tensor, *args, group=group, **kwargs)

    dist.all_reduce = counted
    try:
        with torch.profiler.profile(
            activities=activities, with_stack=True, record_shapes=True
        ) as prof:
            fit(steps, offset)
    finally:
        dist.all_reduce = all_reduce
    counts: collections.Counter = collections.Counter()
    busy = 0.0
    for event in prof.events():
        if not event.name.startswith("c10d::") or "barrier" in event.name:
            continue
        busy += event.cpu_time_total
        frames = [f for f in (event.stack or []) if ".py(" in f]
        plugin = next((f for f in frames if "keras_dtensor_fix" in f), "")
        dtensor = next((f for f in frames if "distributed/tensor" in f), "")
        layer = next(
            (f for f in frames if "keras_hub/src" in f or "keras/src/layers" in f),
            next((f for f in frames if "keras/src" in f), ""),
        )
        where = plugin.split("keras_dtensor_fix/")[-1] or dtensor.split("tensor/")[-1]
        shapes = str(event.input_shapes)[:50]
        counts[(event.name, where or shapes, layer.split("/src/")[-1])] += 1
    if RANK == 0:
        total = sum(counts.values()) / steps
        enqueue = busy / 1e3 / steps
        print(f"  collectives per step: {total:.1f} ({enqueue:.1f} ms in c10d calls;")
        print("  the waits are in the plugin's _poll), by kind, issuer, layer:")
        for (name, where, layer), n in counts.most_common():
            print(f"    {n / steps:5.1f}  {name:28s} {where:40s} {layer}")
        for size, n in sorted(sizes.items()):
            per_step = n / steps
            print(f"  dist.all_reduce over {size} rank(s): {per_step:.1f} per step")


def _group(path: str) -> str:
    for key in (
        "keras_dtensor_fix",
        "torch/distributed/tensor",
        "torch/distributed",
        "torch/autograd",
        "torch/_",
        "keras_hub",
        "keras/src/backend/torch",
        "keras/src/trainers",
        "keras/src/optimizers",
        "keras/src",
        "torch/",
        "wrapt",
        "numpy",
    ):
        if key in path:
            return key
    if path == "~":
        return "builtins (torch C++ ops, c10d waits)"
    return "other Python"


# ---------------------------------------------------------------- driver


def run_config(config: str, cases: list[str], args) -> dict:
    env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    off = config.startswith(("upstream", "single-off"))
    env["KERAS_DTENSOR_FIX"] = "0" if off else "1"
    if config == "eager-noleaves":
        env["KERAS_DTENSOR_FIX_DISABLE"] = "leaves"
    ranks = 4 if config.endswith("4") else 1 if config.startswith("single") else 2
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "out.json")
        script = [__file__, "--worker", config, "--cases", ",".join(cases)]
        script += ["--out", str(out), *_shape_args(args)]
        command = [sys.executable, *script]
        if ranks > 1:
            command[1:1] = [
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={ranks}",
            ]
        if args.lock:  # a shared machine: one process group at a time
            command = ["flock", str(args.lock), *command]
        try:
            proc = subprocess.run(
                command, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as err:
            output, code = f"{err.stdout}{err.stderr}\nTimeout", "timeout"
        results = json.loads(out.read_text()) if out.exists() else {}
    if code != 0 and args.errors:
        with args.errors.open("a") as log:
            log.write(f"==== {config} {cases}: exit {code}\n{output}\n")
    for case in cases:
        results.setdefault(case, {"error": f"exit {code}: {bench._reason(output)}"})
    return results


def _shape_args(args) -> list[str]:
    return [
        f"--steps={args.steps}",
        f"--warmup={args.warmup}",
        f"--batch={args.batch}",
        f"--seq={args.seq}",
        f"--layers={args.layers}",
    ]


def _bootstrap(a: list[float], b: list[float], n: int = 2000) -> tuple[float, float]:
    """95% interval of median(a) / median(b), resampling each side's steps."""
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a)))
        / statistics.median(rng.choices(b, k=len(b)))
        for _ in range(n)
    )
    return ratios[int(0.025 * n)], ratios[int(0.975 * n) - 1]


PAIRS = (  # (numerator, denominator, label): the goals
    ("eager", "upstream", "eager/upstream (goal <= 0.3)"),
    ("eager", "single", "2 ranks/1 process (goal <= 0.65)"),
    ("compiled", "eager", "compiled/eager (goal <= 0.6)"),
    ("eager", "eager-noleaves", "eager: leaves family on/off"),
    ("eager-noleaves", "single", "2 ranks (leaves off)/1 process"),
    ("single", "single-off", "plugin on/off, 1 process (goal <= 1.01)"),
    ("eager4", "upstream4", "4 ranks: eager/upstream"),
    ("eager4", "single", "4 ranks/1 process"),
)


def report(results: dict, args, log) -> None:
    def say(text: str = "") -> None:
        print(text, flush=True)
        log.write(text + "\n")

    for case, configs in results.items():
        kind, hidden = case.split(":")
        tokens = args.batch * args.seq
        say(f"{kind} hidden {hidden}: batch {args.batch} x seq {args.seq}")
        say(
            f"  {'config':11s} {'ms/step':>8s} {'tok/s':>7s} {'rounds':>22s} "
            f"{'coll':>5s} {'dt-ops':>6s} {'graphs':>6s} {'breaks':>6s} "
            f"{'peak MB/rank':>14s}  notes"
        )
        for config, row in configs.items():
            if "error" in row:
                error = re.sub(r"\x1b\[[0-9;]*m|\s+", " ", row["error"])
                say(f"  {config:11s} ERROR {error[:240]}")
                continue
            rounds = ", ".join(f"{r:.0f}" for r in row["rounds"])
            peaks = row.get("peak_mb_ranks") or [row["peak_mb"]]
            peak = "/".join(f"{p:.0f}" for p in peaks if p is not None)
            note = "compiled requested, ran eager" if row.get("ran_eager") else ""
            if "pairs" in row:
                note = (
                    f"{'leaves' if config == 'eager-ab' else 'plugin'} off here "
                    f"{row['ms_off']:.1f} ms: on/off "
                    + bench._pairs_note(row["pairs"], ratio=True)
                )
            coll = "-" if config.startswith("single") else f"{row['collectives']:.0f}"
            ops = (
                "-"
                if config.startswith("single")
                else f"{row.get('dtensor_ops', 0):.0f}"
            )
            say(
                f"  {config:11s} {row['ms']:8.1f} {1e3 * tokens / row['ms']:7.0f} "
                f"{rounds:>22s} {coll:>5s} {ops:>6s} {row['graphs']:6d} "
                f"{row['breaks']:6d} {peak:>14s}  {note}"
            )
        for num, den, label in PAIRS:
            a, b = configs.get(num), configs.get(den)
            if not a or not b or "error" in a or "error" in b:
                continue
            per_round = [x / y for x, y in zip(a["rounds"], b["rounds"], strict=False)]
            low, high = _bootstrap(a["times"], b["times"])
            say(
                f"  {label:42s} {a['ms'] / b['ms']:5.2f} "
                f"[{low:.2f}, {high:.2f}]; by round "
                + ", ".join(f"{r:.2f}" for r in per_round)
            )
        say()


def plot(results: dict, path: Path, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "upstream": "upstream Keras, 2 ranks",
        "eager": "plugin eager, 2 ranks",
        "compiled": "plugin jit_compile=True, 2 ranks",
        "single": "one process, one thread",
    }
    models = sorted(
        {c.split(":")[0] for c in results},
        key=lambda m: -sum(c.startswith(m + ":") for c in results),
    )
    models = [m for m in models if sum(c.startswith(m + ":") for c in results) >= 3]
    models = models or sorted({c.split(":")[0] for c in results})
    fig, axes = plt.subplots(
        1, len(models), figsize=(5.2 * len(models), 4.2), squeeze=False
    )
    for ax, model in zip(axes[0], models, strict=True):
        for config, label in labels.items():
            points = sorted(
                (int(case.split(":")[1]), rows[config]["ms"])
                for case, rows in results.items()
                if case.startswith(model + ":")
                and "error" not in rows.get(config, {"error": 1})
            )
            eager = all(
                rows.get(config, {}).get("ran_eager", True)
                for case, rows in results.items()
                if case.startswith(model + ":")
            )
            if config == "compiled" and eager:
                label = labels[config] + " (ran eager)"
            if points:
                style = "--" if config == "compiled" else "-"
                ax.plot(*zip(*points, strict=True), style, marker="o", label=label)
        failed = []
        for config in labels:
            widths = [
                case.split(":")[1]
                for case, rows in results.items()
                if case.startswith(model + ":") and "error" in rows.get(config, {})
            ]
            if widths:
                failed.append(f"{config} fails at {', '.join(widths)}")
        title = TITLES.get(model, model)
        if failed:
            title += f"\n({'; '.join(failed)})"
        ax.set_title(title, fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(f"hidden size ({args.layers} layers, FFN 4x)")
        ax.set_ylabel("ms per fit() step (median)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"batch {args.batch} x seq {args.seq}, CPU, gloo, 1 thread per rank",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,gemma,llama")
    parser.add_argument("--sizes", default="256,1024", help="hidden sizes")
    parser.add_argument("--sweep", default="", help="more widths, e.g. 128,512")
    parser.add_argument("--sweep-models", default="gpt,gemma", help="for --sweep")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--four", action="store_true", help="also 4 ranks, (2, 2)")
    parser.add_argument("--four-cases", default="", help="cases for --four")
    parser.add_argument(
        "--ab", action="store_true", help="plugin on/off A/B in one process"
    )
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4, help="global batch")
    parser.add_argument("--seq", type=int, default=SEQ)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--timeout", type=int, default=1800, help="s per process")
    parser.add_argument("--errors", type=Path, help="full output of failed runs")
    parser.add_argument("--lock", type=Path, help="run each config under flock")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--log", type=Path, help="write the report here too")
    parser.add_argument("--plot", type=Path, help="ms/step against width (PNG)")
    parser.add_argument("--from-json", type=Path, help="report and plot a --json")
    parser.add_argument("--profile", help="CASE (e.g. gpt:512): phases, hot spots")
    parser.add_argument("--ranks", type=int, default=2, help="for --profile")
    parser.add_argument(
        "--kinds",
        action="store_true",
        help="with --profile: eager and compiled step time by kind of work",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cases", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker == "profile":
        profile_worker(args.cases, args)
        bench.leave()
    if args.worker == "kinds":
        kinds_worker(args.cases, args)
        bench.leave()
    if args.worker:
        worker(args.worker, args.cases.split(","), args.out, args)
        bench.leave()
    if args.profile:
        env = {**os.environ, "KERAS_BACKEND": "torch", "OMP_NUM_THREADS": "1"}
        which = "kinds" if args.kinds else "profile"
        script = [__file__, f"--worker={which}", f"--cases={args.profile}"]
        command = [sys.executable, *script, *_shape_args(args)]
        if args.ranks > 1:
            command[1:1] = ["-m", "torch.distributed.run", "--standalone"]
            command.insert(4, f"--nproc_per_node={args.ranks}")
        return subprocess.run(command, env=env).returncode

    import platform

    import keras
    import torch

    cases = [f"{m}:{s}" for m in args.models.split(",") for s in args.sizes.split(",")]
    for model in args.sweep_models.split(","):
        cases += [f"{model}:{s}" for s in args.sweep.split(",") if s]
    cases = list(dict.fromkeys(cases))
    cases.sort(key=lambda c: (c.split(":")[0], int(c.split(":")[1])))
    configs = [c for c in args.configs.split(",") if c]
    if args.four:
        configs += FOUR_CONFIGS
    four_cases = args.four_cases.split(",") if args.four_cases else cases
    ab_cases = [c for c in cases if int(c.split(":")[1]) <= 256]
    if args.ab:
        configs.append(AB_CONFIG)
    log = (args.log or Path(os.devnull)).open("a")
    head = (
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {platform.machine()}, "
        f"{os.cpu_count()} cores; torch {torch.__version__}, keras {keras.version()}; "
        f"gloo, 1 thread per rank; {args.layers} layers, vocab {VOCAB}, "
        f"batch {args.batch}, seq {args.seq}; {args.warmup} warm-up + {args.steps} "
        f"timed steps, {args.rounds} rounds"
    )
    if args.from_json:
        head = f"report of {args.from_json} (steps {args.steps}, warm-up {args.warmup})"
    print(head, flush=True)
    log.write(head + "\n")
    results: dict[str, dict[str, dict]] = {c: {} for c in cases}
    if args.from_json:
        results = json.loads(args.from_json.read_text())
        args.rounds = 0
    for round_ in range(args.rounds):
        for config in configs:
            run = four_cases if config in FOUR_CONFIGS else cases
            run = ab_cases if config == AB_CONFIG else run
            if not run:
                continue
            start = time.time()
            rows = run_config(config, run, args)
            took, load = time.time() - start, os.getloadavg()[0]
            line = f"round {round_ + 1} {config:10s} ({took:.0f} s, load {load:.1f}):"
            for case, row in rows.items():
                line += f" {case} " + (
                    "ERROR" if "error" in row else f"{row['ms']:.0f}"
                )
                results[case][config] = _merge(results[case].get(config), row)
            print(line, flush=True)
            log.write(line + "\n")
            log.flush()
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    print()
    report(results, args, log)
    if args.plot:
        plot(results, args.plot, args)
    return 0


def _merge(previous: dict | None, row: dict) -> dict:
    if "error" not in row:
        row = {**row, "rounds": [row["ms"]]}
    if previous is None or "error" in row:
        return row if previous is None or "error" in previous else previous
    if "error" in previous:
        return row
    times = previous["times"] + row["times"]
    merged = {
        **row,
        "times": times,
        "ms": statistics.median(times),
        "rounds": previous["rounds"] + row["rounds"],
    }
    if "pairs" in row:  # single-ab: pool side b and the block pairs too
        merged["times_off"] = previous["times_off"] + row["times_off"]
        merged["ms_off"] = statistics.median(merged["times_off"])
        merged["pairs"] = previous["pairs"] + row["pairs"]
    return merged


if __name__ == "__main__":
    sys.exit(main())
