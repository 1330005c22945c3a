"""What one token of ``generate()`` runs: DTensor-dispatched ops and collectives.

A tiny random ``GemmaCausalLM`` (4 layers, vocabulary 1024, heads 4 / kv heads
2, ``--hidden``), ``compile(sampler="greedy")``, 2 prompts of ``--prompt``
tokens (16) to ``--length`` (64), sharded by Gemma's own ``get_layout_map``
on (1, N), or on one process with no distribution; ``--compile``:
``jit_compile=True``, so that ``generate()`` compiles its token step (the
``generate`` family, sharded only: one process generates eagerly). Prints
ms/token (median of 3 calls after the first),
eager: aten ops per token with a DTensor among their arguments and without,
the most frequent DTensor ops; collectives per token (torch's profiler);
sharded, what one all-reduce of a token's hidden vector costs here (the
plugin's path, the median of 200: the machine's floor per collective).
Counts do not depend on the machine's load; times do.

    torchrun --standalone --nproc_per_node=2 benchmarks/generate_ops.py
    python benchmarks/generate_ops.py          # one process, the reference
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

PROMPT, LENGTH = 16, 64


class Count(TorchDispatchMode):
    """Counts aten ops, those with a DTensor argument by name."""

    def __init__(self) -> None:
        super().__init__()
        self.dtensor: collections.Counter[str] = collections.Counter()
        self.plain = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
            self.dtensor[str(func)] += 1
        else:
            self.plain += 1
        return func(*args, **kwargs)


def all_reduce_ms(hidden: int) -> float:
    """Median ms of the plugin's all-reduce of a (2, 1, hidden) tensor."""
    from torch.distributed.device_mesh import init_device_mesh

    from keras_dtensor_fix.dtensor import all_reduce_sum

    mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
    value, times = torch.randn(2, 1, hidden), []
    for _ in range(220):
        start = time.perf_counter()
        all_reduce_sum(value, mesh, (0,))
        times.append(time.perf_counter() - start)
    return 1000 * float(np.median(times[20:]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--compile",
        action="store_true",
        help="jit_compile=True: generate() compiles its token step (the plugin)",
    )
    parser.add_argument("--prompt", type=int, default=PROMPT)
    parser.add_argument("--length", type=int, default=LENGTH)
    parser.add_argument(
        "--table",
        type=int,
        default=0,
        help="print the profiled call's N costliest ops by self time",
    )
    parser.add_argument(
        "--timing-only",
        action="store_true",
        help="ms/token and the first call only (no counting or profiled calls)",
    )
    args = parser.parse_args()
    import keras_hub

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        keras.distribution.initialize()
        devices = keras.distribution.list_devices()
        mesh = keras.distribution.DeviceMesh((1, world), ["batch", "model"], devices)
        layouts = keras_hub.models.GemmaBackbone.get_layout_map(mesh)
        distribution = keras.distribution.ModelParallel(
            layout_map=layouts, batch_dim_name="batch"
        )
        distribution.auto_shard_dataset = False
        keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=1024,
        num_layers=4,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        head_dim=args.hidden // 4,
    )
    model = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    model.compile(sampler="greedy", jit_compile=args.compile)
    prompt, length = args.prompt, args.length
    ids = np.zeros((2, length), "int32")
    ids[:, :prompt] = np.random.default_rng(0).integers(1, 1024, (2, prompt))
    mask = np.zeros((2, length), bool)
    mask[:, :prompt] = True
    inputs = {"token_ids": ids, "padding_mask": mask}
    tokens = length - prompt

    def generate():
        return model.generate(inputs, stop_token_ids=None)

    start = time.perf_counter()
    first = np.asarray(generate()["token_ids"])
    first_call = time.perf_counter() - start
    times = []
    for _ in range(3):
        start = time.perf_counter()
        out = generate()
        times.append(time.perf_counter() - start)
    count = Count()
    if not (args.compile or args.timing_only):  # a dispatch mode would stop
        with count:  # the compiled step
            generate()
    with torch.profiler.profile() as profile:
        if not args.timing_only:
            generate()
    collectives = collections.Counter(
        e.name for e in profile.events() if e.name.startswith(("c10d::", "_c10d"))
    )
    reduce_ms = all_reduce_ms(args.hidden) if world > 1 else None
    if int(os.environ.get("RANK", "0")) == 0:
        ms = 1000 * float(np.median(times)) / tokens
        tokens_now = np.asarray(out["token_ids"])
        shown = tokens_now[0, prompt : prompt + 8].tolist()
        compiled = "compiled" if args.compile else "eager"
        print(
            f"{world} process(es), {compiled}, hidden {args.hidden}, "
            f"{prompt}/{tokens}: {ms:.1f} ms/token"
        )
        record = {
            "world": world,
            "compiled": args.compile,
            "hidden": args.hidden,
            "prompt": prompt,
            "new": tokens,
            "ms_per_token": round(ms, 2),
            "first_call_s": round(first_call, 1),
            "tokens": tokens_now.tolist(),
            "same_tokens": tokens_now.tolist() == first.tolist(),
        }
        print("RECORD " + json.dumps(record))
        print(f"first generated tokens: {shown}")
        print(
            f"first call {first_call:.1f} s (the compile, if any); same tokens "
            f"then: {tokens_now.tolist() == first.tolist()}; dynamo graphs: "
            f"{torch._dynamo.utils.counters['stats']['unique_graphs']}"
        )
        print(
            f"aten ops per token: {sum(count.dtensor.values()) / tokens:.1f} with "
            f"a DTensor, {count.plain / tokens:.1f} without"
        )
        for name, n in count.dtensor.most_common(15):
            print(f"  {n / tokens:6.1f}  {name}")
        for name, n in collectives.most_common(8):
            print(f"  {n / tokens:6.2f}  {name} (collective)")
        if args.table:
            averages = profile.key_averages()
            print(averages.table(sort_by="self_cpu_time_total", row_limit=args.table))
        if reduce_ms is not None:
            print(f"one all-reduce of (2, 1, {args.hidden}): {reduce_ms:.2f} ms")
    sys.stdout.flush()
    os._exit(0)  # skips a gloo teardown that can abort (tests/support.leave)


if __name__ == "__main__":
    main()
