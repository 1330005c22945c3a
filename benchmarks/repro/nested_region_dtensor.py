"""torch's regional compilation over DTensor operands: what fails, and a fix.

A stack of identical blocks of DTensor weights, compiled whole
(``fullgraph=True``) with each block marked ``nested_compile_region``, as
torchtitan marks a transformer block. Pure torch, 2 gloo processes:

    torchrun --standalone --nproc_per_node=2 benchmarks/repro/nested_region_dtensor.py
        [--layers 4] [--no-region] [--fix] [--backend aot_eager]

With torch 2.13 (and ``--layers`` 3 or more) it fails twice over (2.15.0 still
fails at 1; ``results/2026-11-29-nested-region-torch-2.15.md``):

1. dynamo's subgraph reuse (``torch/_dynamo/variables/invoke_subgraph.py``):
   after a region was traced, ``save_reuse_entry`` keeps each output's shape,
   stride, dtype, device and ``requires_grad`` only, and
   ``stamp_out_subgraph`` makes the next call's outputs with
   ``torch.empty_strided``: plain fake tensors where the region returned
   DTensors. The op after the third block then mixes a DTensor with a plain
   tensor (``aten.add.Tensor got mixed torch.Tensor and DTensor``). Two
   blocks pass: the second call is traced again (its input is not a graph
   input), only the third is stamped out.
2. With reuse refused for DTensor outputs, AOT autograd meets the
   ``invoke_subgraph`` HOP on DTensors: ``There was no rule registered for
   HOP invoke_subgraph and subclass DTensor``.

``--fix`` applies the two changes that make it run, with the same loss and
gradients as ``--no-region``: stamped-out outputs are rebuilt as DTensors from
the specs the first trace returned, and ``invoke_subgraph`` on DTensors runs
its subgraph inline. It saves no start time: inline, AOT autograd traces every
block through DTensor's dispatch again, and that is where a block's cost is
(each added block costs the same with and without regions). What would save
it is a DTensor rule for ``invoke_subgraph`` that traces the subgraph once on
local tensors and calls that graph per block: torch's to add.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor


def apply_fix() -> None:
    """The two changes above, on torch 2.13's private modules."""
    import torch._dynamo.variables.invoke_subgraph as reuse
    from torch._higher_order_ops.invoke_subgraph import invoke_subgraph

    specs: dict[str, list] = {}
    save, stamp = reuse.save_reuse_entry, reuse.stamp_out_subgraph

    @functools.wraps(save)
    def save_reuse_entry(tx, fn_var, fingerprint, body_name, *args, **kwargs):
        example_value = args[4]  # after body_gmod, config, p_args, body_r
        specs[body_name] = [
            (tuple(t._local_tensor.shape), t._local_tensor.stride(), t._spec)
            if isinstance(t, DTensor)
            else None
            for t in example_value
            if isinstance(t, torch.Tensor)
        ]
        return save(tx, fn_var, fingerprint, body_name, *args, **kwargs)

    class Outputs:
        """``torch`` for ``stamp_out_subgraph``: DTensor outputs stay DTensors."""

        def __init__(self, found: list) -> None:
            self._found = iter(found)

        def __getattr__(self, name: str):
            return getattr(torch, name)

        def empty_strided(self, shape, stride, **kwargs):
            found = next(self._found, None)
            if found is None:
                return torch.empty_strided(shape, stride, **kwargs)
            local_shape, local_stride, spec = found
            grad = kwargs.pop("requires_grad", False)
            local = torch.empty_strided(local_shape, local_stride, **kwargs)
            return DTensor(local, spec, requires_grad=grad)

    @functools.wraps(stamp)
    def stamp_out_subgraph(tx, fingerprint, cached):
        found = specs.get(cached.body_name)
        if not found or not any(found):
            return stamp(tx, fingerprint, cached)
        reuse.torch = Outputs(found)
        try:
            return stamp(tx, fingerprint, cached)
        finally:
            reuse.torch = torch

    reuse.save_reuse_entry = save_reuse_entry
    reuse.stamp_out_subgraph = stamp_out_subgraph

    @invoke_subgraph.py_impl(DTensor)
    def _inline(subgraph, identifier, *operands):
        return subgraph(*operands)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-region", action="store_true")
    parser.add_argument("--fix", action="store_true")
    parser.add_argument("--backend", default="aot_eager")
    args = parser.parse_args()
    if args.fix:
        apply_fix()
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rank = dist.get_rank()

    def block(x, w1, w2):  # Megatron: column then row parallel
        return torch.relu(x @ w1) @ w2

    if not args.no_region:
        block = torch.compiler.nested_compile_region(block)

    def model(x, weights):
        for w1, w2 in weights:
            x = x + block(x, w1, w2)
        return x.sum()

    torch.manual_seed(0)
    weights = [
        (
            distribute_tensor(torch.randn(16, 32) / 4, mesh, [Shard(1)]),
            distribute_tensor(torch.randn(32, 16) / 6, mesh, [Shard(0)]),
        )
        for _ in range(args.layers)
    ]
    for w1, w2 in weights:
        w1.requires_grad_(), w2.requires_grad_()
    x = distribute_tensor(torch.randn(8, 16), mesh, [Replicate()])
    step = torch.compile(model, backend=args.backend, fullgraph=True)
    began = time.perf_counter()
    try:
        loss = step(x, weights)
        loss.backward()
        grad = float(weights[0][0].grad.full_tensor().norm())
        print(
            f"rank {rank}: ok, loss {float(loss.full_tensor()):.6g}, first grad "
            f"norm {grad:.6g}, {time.perf_counter() - began:.1f} s",
            flush=True,
        )
    except Exception as exc:  # noqa: BLE001 - what the reproducer shows
        print(f"rank {rank}: {type(exc).__name__}: {str(exc)[:600]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
