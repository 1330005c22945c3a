"""Local einsum on two ranks: values and gradients equal plain torch's.

Run as ``torch.distributed.run --nproc_per_node=2 einsum.py``. For each case
(an equation, shapes, the operands' placements) it checks what
``keras_dtensor_fix.dtensor.einsum.local_einsum`` returns, and the operands'
gradients after a backward through ``reduce_partial`` (as the numpy wrapper
runs it), against ``torch.einsum`` on the full plain tensors; likewise each
``LINEAR_CASES`` dense layer (``local_dense``) against ``act(x @ w + b)``;
and, on a (1, 2) mesh, the Megatron planning helpers of ``dtensor.megatron``
(``MEGATRON``: which weights split where, a block input's local part, the
placements of what it returns). It prints one JSON line from rank 0,
``CASES {name: "local" | "fallback" | bool}``, and exits non-zero on a
failure on any rank.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
)

from keras_dtensor_fix.dtensor import reduce_partial
from keras_dtensor_fix.dtensor.einsum import (
    linear_equation,
    local_dense,
    local_einsum,
    local_matmul,
)
from keras_dtensor_fix.dtensor.megatron import local_part, with_split
from keras_dtensor_fix.dtensor.planner import shard_dim, split_axis

R = Replicate()
#: name -> (equation, shapes, placements, whether the local path applies)
CASES = {
    "column": ("abk,kn->abn", [(4, 3, 6), (6, 8)], [R, Shard(1)], True),
    "row": ("abk,kn->abn", [(4, 3, 6), (6, 8)], [Shard(2), Shard(0)], True),
    "uneven_rows": ("abk,kn->abn", [(4, 3, 6), (6, 8)], [Shard(1), R], False),
    "batch_rows": ("abk,kn->abn", [(4, 2, 6), (6, 8)], [Shard(0), R], True),
    "heads_in": ("abc,cde->abde", [(2, 5, 6), (6, 4, 3)], [R, Shard(1)], True),
    "scores": ("aecd,abcd->acbe", [(2, 5, 4, 3)] * 2, [Shard(2), Shard(2)], True),
    "context": (
        "acbe,aecd->abcd",
        [(2, 4, 5, 5), (2, 5, 4, 3)],
        [Shard(1), Shard(2)],
        True,
    ),
    "heads_out": (
        "abcd,cde->abe",
        [(2, 5, 4, 3), (4, 3, 6)],
        [Shard(2), Shard(0)],
        True,
    ),
    "summed_letter": ("abc,cd->ad", [(4, 3, 6), (6, 8)], [R, Shard(1)], True),
    "replicated": ("ij,jk->ik", [(3, 4), (4, 5)], [R, R], True),
    # A sharded letter held replicated by the other operand: that operand is
    # split locally on it (Llama's attention output against its kernel).
    "replicated_partner": ("abk,kn->abn", [(4, 3, 6), (6, 8)], [Shard(2), R], True),
    # Two letters sharded on one mesh axis (batch-split activations against a
    # kernel sharded on "batch" too, keras-hub's 2-D layouts): the kernel is
    # gathered on that axis, the product stays batch-split.
    "two_letters": (
        "btnh,nhd->btd",
        [(4, 3, 2, 4), (2, 4, 6)],
        [Shard(0), Shard(2)],
        True,
    ),
    # No local form: an uneven shard, a Partial operand, an ellipsis.
    "uneven": ("ij,jk->ik", [(3, 4), (4, 5)], [R, Shard(1)], False),
    "partial": ("ij,jk->ik", [(4, 4), (4, 6)], [Partial(), R], False),
    "ellipsis": ("...k,kn->...n", [(4, 3, 6), (6, 8)], [R, Shard(1)], False),
}


PLAIN = None  # the input is a plain tensor holding the full value


def _softmax(x):
    return torch.softmax(x, dim=-1)


#: name -> (x shape, x placement or PLAIN, kernel shape, kernel placement,
#: bias placement or None, activation and its scope, whether it runs locally)
LINEAR_CASES = {
    "linear_column": ((4, 6), PLAIN, (6, 8), Shard(1), Shard(0), "relu", True),
    "linear_column_grad": ((4, 6), R, (6, 8), Shard(1), Shard(0), "relu", True),
    "linear_row": ((4, 6), Shard(1), (6, 8), Shard(0), R, None, True),
    "linear_row_softmax": ((4, 6), Shard(1), (6, 8), Shard(0), R, "softmax", True),
    "linear_3d": ((2, 3, 6), R, (6, 8), Shard(1), Shard(0), "relu", True),
    "linear_batch": ((4, 6), Shard(0), (6, 8), R, R, "relu", True),
    "linear_no_bias": ((4, 6), R, (6, 8), Shard(1), None, None, True),
    # No local form: a replicated bias next to a sharded output, a softmax over
    # a sharded last dim, a plain input that needs a gradient, an uneven shard.
    "linear_bias_replicated": ((4, 6), R, (6, 8), Shard(1), R, None, False),
    "linear_softmax_split": ((4, 6), R, (6, 8), Shard(1), Shard(0), "softmax", False),
    "linear_plain_grad": (
        (4, 6),
        "plain_grad",
        (6, 8),
        Shard(1),
        Shard(0),
        None,
        False,
    ),
    "linear_uneven": ((4, 6), R, (6, 7), Shard(1), Shard(0), None, False),
}
ACTIVATIONS = {"relu": (torch.relu, "elementwise"), "softmax": (_softmax, "last")}


def check_linear(name: str, mesh, seed: int) -> str:
    x_shape, x_place, w_shape, w_place, b_place, act, local = LINEAR_CASES[name]
    generator = torch.Generator().manual_seed(seed)
    x_full = torch.randn(x_shape, generator=generator)
    w_full = torch.randn(w_shape, generator=generator)
    b_full = torch.randn(w_shape[1], generator=generator)
    if x_place is PLAIN:
        x = x_full.clone()
    elif x_place == "plain_grad":
        x = x_full.clone().requires_grad_()
    else:
        x = distribute_tensor(x_full, mesh, [x_place]).detach().requires_grad_()
    w = distribute_tensor(w_full, mesh, [w_place]).detach().requires_grad_()
    b = None
    if b_place is not None:
        b = distribute_tensor(b_full, mesh, [b_place]).detach().requires_grad_()
    fn, scope = ACTIVATIONS[act] if act else (None, "elementwise")
    got = local_dense(linear_equation(x.ndim), x, w, b, fn, scope)
    assert (got is not None) == local, f"{name}: local path {got is not None}"
    if got is None:
        return "fallback"
    plain = [t.clone().requires_grad_() for t in (x_full, w_full, b_full)]
    want = plain[0] @ plain[1] + (plain[2] if b is not None else 0)
    want = fn(want) if fn else want
    weights = torch.randn(want.shape, generator=generator)
    (want * weights).sum().backward()
    assert not any(p.is_partial() for p in got.placements), name
    torch.testing.assert_close(got.full_tensor(), want.detach(), msg=name)
    (got * distribute_tensor(weights, mesh, [R])).sum().backward()
    pairs = [(w, plain[1]), (b, plain[2])]
    if isinstance(x, DTensor):
        pairs.append((x, plain[0]))
    for operand, reference in pairs:
        if operand is None:
            continue
        assert isinstance(operand.grad, DTensor), f"{name}: grad {operand.grad!r}"
        torch.testing.assert_close(
            operand.grad.full_tensor(), reference.grad, msg=f"{name} grad"
        )
    return "local"


def check(name: str, mesh, seed: int) -> str:
    equation, shapes, placements, local = CASES[name]
    generator = torch.Generator().manual_seed(seed)
    fulls = [torch.randn(shape, generator=generator) for shape in shapes]
    operands = []
    for full, placement in zip(fulls, placements, strict=True):
        if placement.is_partial():
            # Each rank holds half of the value: their sum is ``full``.
            operand = DTensor.from_local(full / 2, mesh, [placement])
        else:
            operand = distribute_tensor(full, mesh, [placement])
        operands.append(operand.detach().requires_grad_())
    got = local_einsum(equation, operands)
    assert (got is not None) == local, f"{name}: local path {got is not None}"
    if got is None:
        return "fallback"
    plain = [f.clone().requires_grad_() for f in fulls]
    want = torch.einsum(equation, *plain)
    weights = torch.randn(want.shape, generator=generator)
    (want * weights).sum().backward()
    settled = reduce_partial(got)
    torch.testing.assert_close(settled.full_tensor(), want.detach(), msg=name)
    loss = (settled * distribute_tensor(weights, mesh, [R])).sum()
    loss.backward()
    for i, (operand, reference) in enumerate(zip(operands, plain, strict=True)):
        grad = operand.grad
        assert isinstance(grad, DTensor), f"{name}: operand {i} grad {type(grad)}"
        torch.testing.assert_close(
            grad.full_tensor(), reference.grad, msg=f"{name} operand {i} grad"
        )
    return "local"


def check_matmul(mesh) -> str:
    """``local_matmul`` takes 3-d by 2-d and batched products (values and
    gradients) and leaves 2-d ones to DTensor."""
    x = distribute_tensor(torch.randn(4, 3, 6), mesh, [R])
    w = distribute_tensor(torch.randn(6, 8), mesh, [Shard(1)])
    got = local_matmul(x, w)
    assert got is not None and tuple(got.placements) == (Shard(2),)
    torch.testing.assert_close(got.full_tensor(), x.full_tensor() @ w.full_tensor())
    assert local_matmul(distribute_tensor(torch.randn(4, 6), mesh, [R]), w) is None
    # batched, broadcast on a size-1 dim: grouped attention's logits, heads split
    torch.manual_seed(0)  # every rank holds the same whole operands
    q = torch.randn(2, 2, 3, 1, 8, requires_grad=True)
    k = torch.randn(2, 2, 1, 8, 5, requires_grad=True)
    dq, dk = (
        distribute_tensor(t.detach(), mesh, [Shard(1)]).requires_grad_() for t in (q, k)
    )
    got = local_matmul(dq, dk)
    assert got is not None and tuple(got.placements) == (Shard(1),)
    torch.testing.assert_close(got.full_tensor(), q @ k)
    got.full_tensor().sum().backward()
    (q @ k).sum().backward()
    torch.testing.assert_close(dq.grad.full_tensor(), q.grad)
    torch.testing.assert_close(dk.grad.full_tensor(), k.grad)
    return "local"


def check_megatron() -> dict[str, bool]:
    """``dtensor.megatron`` on a (1, 2) mesh, as Gemma's layout places a block."""
    mesh = init_device_mesh("cpu", (1, dist.get_world_size()))
    rank = mesh.get_local_rank(1)
    torch.manual_seed(0)
    full = torch.randn(4, 6, 8)

    def put(*placements):
        return distribute_tensor(full, mesh, placements)

    heads = put(Shard(1), Shard(0))  # (heads, hidden, dim): heads on "model"
    norm = put(R, R)
    cache = torch.randn(2, 2, 5, 4, 3)
    x = put(Shard(0), R)  # batch on the one-rank axis
    return {
        "megatron split_axis: one model axis": split_axis([heads, norm]) == (mesh, 1),
        "megatron split_axis: the one-rank axis splits nothing": split_axis([norm, x])
        is None,
        "megatron split_axis: one dim per value": split_axis([heads, put(R, Shard(2))])
        == (mesh, 1),
        "megatron split_axis: Partial refused": split_axis(
            [DTensor.from_local(full, mesh, (R, Partial()), run_check=False)]
        )
        is None,
        "megatron shard_dim": shard_dim(heads, 1) == 0 and shard_dim(heads, 0) == 1,
        "megatron local_part: whole input": torch.equal(
            local_part(x, mesh, 1, None), full
        ),
        "megatron local_part: split input refused": local_part(
            put(R, Shard(1)), mesh, 1, None
        )
        is None,
        "megatron local_part: plain cache cut by heads": torch.equal(
            local_part(cache, mesh, 1, 3, x), cache[:, :, :, 2 * rank : 2 * rank + 2]
        ),
        "megatron local_part: split cache kept": torch.equal(
            local_part(distribute_tensor(cache, mesh, (R, Shard(3))), mesh, 1, 3),
            cache[:, :, :, 2 * rank : 2 * rank + 2],
        ),
        "megatron local_part: cache split elsewhere refused": local_part(
            distribute_tensor(cache, mesh, (R, Shard(2))), mesh, 1, 3
        )
        is None,
        "megatron local_part: uneven cut refused": local_part(
            torch.ones(3, 5), mesh, 1, 1
        )
        is None,
        "megatron local_part: a scalar is itself": local_part(
            torch.tensor(3), mesh, 1, None
        )
        .eq(3)
        .item(),
        "megatron with_split": with_split(x, mesh, 1, 3) == (Shard(0), Shard(3))
        and with_split(None, mesh, 1, None) == (R, R),
    }


def main() -> int:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results, status = {}, 0
    for cases, checker in ((CASES, check), (LINEAR_CASES, check_linear)):
        for seed, name in enumerate(cases):
            try:
                results[name] = checker(name, mesh, seed)
            except Exception:  # noqa: BLE001 - report, go on, fail at the end
                import traceback

                traceback.print_exc()
                results[name] = "FAILED"
                status = 1
    results["matmul"] = check_matmul(mesh)
    results.update(check_megatron())
    if dist.get_rank() == 0:
        print("CASES " + json.dumps(results), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import leave  # skips a teardown that can abort: see leave()

    leave(main())
