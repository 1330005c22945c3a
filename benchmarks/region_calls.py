"""What a compiled region's call costs, DTensor against local tensors: pure torch.

Blocks mode runs each repeated block as one compiled region on DTensors: AOT
autograd's runtime wrapper unwraps every DTensor input and wraps every output
(and, in the backward, every gradient). The issue's other design runs the
region on each rank's local tensors, Megatron's collectives inside the graph,
so nothing crosses the region's edge as a DTensor. Here a stack of ``--layers``
Megatron MLP blocks (``x + relu(x @ w1) @ w2``, ``w1`` column-split, ``w2``
row-split on a 1-D mesh of every process) trains with SGD-free steps (forward,
backward, gradients kept) four ways, taking turns, in one launch:

  whole    the whole stack's forward one ``torch.compile``'d graph (DTensors)
  blocks   each block through one compiled block function (DTensors), the
           stack's loop eager: blocks mode's region calls
  local    each block through one compiled function on local tensors, the
           all-reduce after ``w2`` and Megatron's "f" before ``w1`` as
           autograd functions of ``torch.distributed._functional_collectives``
           inside the graph; the weights are local tensors
  eager    the stack on DTensors, uncompiled

and prints each mode's median ms a step (rank 0) and the ratio to ``whole``.

    torchrun --standalone --nproc_per_node=2 benchmarks/region_calls.py
        [--layers 2,8] [--hidden 256] [--rows 1024] [--steps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


class _Reduce(torch.autograd.Function):
    """Megatron's "g": all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ReduceGrad(torch.autograd.Function):
    """Megatron's "f": identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return funcol.all_reduce(grad, "sum", ctx.group), None


def block(x, w1, w2):
    y = torch.relu(x @ w1) @ w2
    if isinstance(y, DTensor):  # Megatron's "g": the row-parallel sum, explicit
        y = y.redistribute(y.device_mesh, [Replicate()])
    return x + y


def local_block(x, w1, w2, group):
    h = torch.relu(_ReduceGrad.apply(x, group) @ w1) @ w2
    return x + _Reduce.apply(h, group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", default="2,8")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    # A DTensor graph holds this process's shard offsets and group names, and
    # the compile caches are shared by the processes: without a tag of its
    # own a process may run another's graph (as the plugin's cache_key keeps).
    torch.compiler.config.cache_key_tag = f"region_calls:rank={dist.get_rank()}"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    group = mesh.get_group()
    rank0 = dist.get_rank() == 0
    compiled_block = torch.compile(block, dynamic=False)
    compiled_local = torch.compile(local_block, dynamic=False)

    def depth(layers: int) -> None:
        torch.manual_seed(0)
        h = args.hidden
        full = [
            (torch.randn(h, 4 * h) / h**0.5, torch.randn(4 * h, h) / (2 * h))
            for _ in range(layers)
        ]
        weights = [
            (
                distribute_tensor(a, mesh, [Shard(1)]).requires_grad_(),
                distribute_tensor(b, mesh, [Shard(0)]).requires_grad_(),
            )
            for a, b in full
        ]
        local = [
            (
                w1.to_local().detach().requires_grad_(),
                w2.to_local().detach().requires_grad_(),
            )
            for w1, w2 in weights
        ]
        x_full = torch.randn(args.rows, h)
        x = distribute_tensor(x_full, mesh, [Replicate()])

        def stack(x, weights):
            for w1, w2 in weights:
                x = block(x, w1, w2)
            return x.sum()

        whole = torch.compile(stack, dynamic=False)

        def run(mode: str) -> None:
            if mode == "local":
                y = x_full
                for w1, w2 in local:
                    y = compiled_local(y, w1, w2, group)
                y.sum().backward()
                return
            if mode == "whole":
                whole(x, weights).backward()
                return
            y = x
            for w1, w2 in weights:
                y = (compiled_block if mode == "blocks" else block)(y, w1, w2)
            y.sum().backward()

        modes = ("whole", "blocks", "local", "eager")
        times: dict[str, list[float]] = {m: [] for m in modes}
        for mode in modes:  # compile, warm up
            for _ in range(3):
                run(mode)
        for _ in range(args.rounds):
            for mode in modes:
                for _ in range(args.steps):
                    dist.barrier()
                    began = time.perf_counter()
                    run(mode)
                    times[mode].append(time.perf_counter() - began)
        # the modes agree: one block's gradient, local against DTensor
        for w1, _ in weights:
            w1.grad = None
        for w1, _ in local:
            w1.grad = None
        grads = {}
        for mode in ("blocks", "eager", "whole"):
            run(mode)
            grads[mode] = weights[0][0].grad.to_local()
            for w1, w2 in weights:
                w1.grad = w2.grad = None
        run("local")
        # one block's gradient against one process's, DTensor and local
        a = full[0][0].clone().requires_grad_()
        reference = x_full
        for i, (w1, w2) in enumerate(full):
            reference = block(reference, a if i == 0 else w1, w2)
        reference.sum().backward()
        mine = a.grad.chunk(dist.get_world_size(), dim=1)[dist.get_rank()]
        scale = float(mine.abs().max())
        errors = {
            **{m: float((g - mine).abs().max()) / scale for m, g in grads.items()},
            "local": float((local[0][0].grad - mine).abs().max()) / scale,
        }
        if rank0:
            base = statistics.median(times["whole"])
            medians = {m: statistics.median(t) for m, t in times.items()}
            cells = ", ".join(
                f"{m} {1e3 * t:.2f} ms ({t / base:.2f}x)" for m, t in medians.items()
            )
            print(
                f"{layers} layers: {cells}; error against one process {errors}",
                flush=True,
            )

    for layers in [int(n) for n in args.layers.split(",")]:
        depth(layers)
    dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
