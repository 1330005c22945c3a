"""The keras-hub benchmark's profiles (``hub.py --profile CASE [--kinds]``).

Where an eager step's time goes: wall time per phase, cProfile's hot spots
grouped by package, the sources of each collective; with ``--kinds``, eager
and compiled step time by kind of work.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import bench  # noqa: E402  benchmarks/bench.py: _pin(), _reason(), leave()
from hub_worker import (  # noqa: E402
    RANK,
    WORLD,
    build,
    case_data,
    distribute,
    fit_rows,
)


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
    distribute(kind, (1, WORLD))
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
    x, y, per_rank = case_data(args.batch, args.warmup + 2 * steps + 2, args.seq, 1)

    def fit(n: int, offset: int) -> float:
        part = slice(offset * per_rank, (offset + n) * per_rank)
        start = time.perf_counter()
        fit_rows(model, x, y, part, per_rank)
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

    poll = collectives.poll_work

    def recorded_poll(work):  # the plugin's eager all-reduce waits, as an op
        with torch.profiler.record_function("plugin all-reduce wait"):
            return poll(work)

    collectives.poll_work = recorded_poll  # where _reduce_in_place looks it up
    if WORLD > 1:
        keras.distribution.initialize()
    kind, hidden = case.split(":")
    steps = args.steps
    rows = {}
    for config in ("eager", "compiled"):
        distribute(kind, (1, WORLD))
        keras.utils.set_random_seed(0)
        torch._dynamo.reset()
        model = build(kind, int(hidden), args.layers, args.seq)
        model.jit_compile = config == "compiled"
        x, y, per_rank = case_data(args.batch, args.warmup + steps, args.seq, 1)

        fit_rows(model, x, y, slice(0, args.warmup * per_rank), per_rank)
        timed = slice(args.warmup * per_rank, (args.warmup + steps) * per_rank)
        start = time.perf_counter()
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU]
        ) as prof:
            fit_rows(model, x, y, timed, per_rank)
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
