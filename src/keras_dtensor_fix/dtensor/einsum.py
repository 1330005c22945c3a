"""Einsum on DTensors as one local einsum per rank (pure torch).

DTensor runs ``einsum`` as views, permutes and bmm, each through sharding propagation
(views take its slow path). Where :func:`.planner.product` finds a local form, the
result is one local ``torch.einsum``, sharded on a letter's dim or ``Partial("sum")``
where it is summed, with a local backward."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from itertools import zip_longest
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_dtensor_fix.dtensor import (
    all_reduce_sum,
    placed,
    planner,
    redistributed,
    reducing_gradient,
    replicate,
    same_mesh,
    unwrap_local,
    wrap_local,
)
from keras_dtensor_fix.dtensor.placement import without_partials

__all__ = [
    "linear_equation",
    "local_dense",
    "local_einsum",
    "local_matmul",
]

Placements = tuple[Any, ...]


def local_einsum(equation: str, operands: Sequence[Any]) -> DTensor | None:
    """``torch.einsum(equation, *operands)`` on local shards, or None. Compiled too:
    DTensor's einsum makes strided shards its ``bmm`` has no rule for (torch 2.13;
    grouped-query attention)."""
    if len(operands) < 2:
        return None
    first = operands[0]
    if not isinstance(first, DTensor) or not first.dtype.is_floating_point:
        return None
    mesh = first.device_mesh
    if any(
        not isinstance(o, DTensor)
        or o.dtype != first.dtype
        or not same_mesh(o.device_mesh, mesh)
        for o in operands[1:]
    ):
        return None
    wanted = _uncached(planner.aligned)(
        equation, tuple(tuple(o.placements) for o in operands), tuple(mesh.shape)
    )
    operands = [
        o if w == tuple(o.placements) else placed(o, w)
        for o, w in zip(operands, wanted, strict=True)
    ]
    found = _uncached(planner.product)(
        equation,
        tuple(tuple(o.shape) for o in operands),
        tuple(tuple(o.placements) for o in operands),
        tuple(mesh.shape),
    )
    if found is None:
        return None
    operands = [
        reducing_gradient(o) if any(p.is_partial() for p in grad) else o
        for o, grad in zip(operands, found.grads, strict=True)
    ]
    if not torch.compiler.is_compiling():
        return _LocalEinsum.apply(equation, found, *operands)
    # _LocalEinsum as the DTensor calls dynamo traces
    locals_ = [
        o.to_local(grad_placements=g)
        for o, g in zip(operands, found.grads, strict=True)
    ]
    result = torch.einsum(equation, *locals_)
    return DTensor.from_local(result, mesh, found.placements, run_check=False)


def _uncached(planned: Any) -> Any:
    """``planned`` without its ``lru_cache`` when traced (dynamo warns at each trace
    through one)."""
    return planned.__wrapped__ if torch.compiler.is_compiling() else planned


def local_matmul(x: Any, w: Any) -> DTensor | None:
    """``x @ w`` as :func:`local_einsum`, where ``x`` has batch dims (3 or more):
    DTensor's matmul flattens them with views (its slow path; compiled, strided shards).
    A 2-d product is one cached ``mm`` for DTensor."""
    if not (isinstance(x, DTensor) and isinstance(w, DTensor) and 3 <= x.ndim <= 10):
        return None
    if w.ndim == 2:
        return local_einsum(linear_equation(x.ndim), (x, w))
    equation = batched_equation(tuple(x.shape), tuple(w.shape))
    return None if equation is None else local_einsum(equation, (x, w))


def batched_equation(left: tuple[int, ...], right: tuple[int, ...]) -> str | None:
    """The einsum of ``matmul`` on ``left`` by ``right`` shapes (3 to 10 dims), or None;
    a broadcast batch dim of size 1 gets a letter of its own."""
    if not (3 <= len(left) <= 10 and 3 <= len(right) <= 10) or left[-1] != right[-2]:
        return None
    letters = iter("abcdefghijlopqrtuvwxyzABCDEFGHIJ")
    lhs, rhs, out = "", "", ""
    for a, b in zip_longest(left[-3::-1], right[-3::-1]):  # batch dims, last first
        if a is not None and b is not None and a != b and 1 not in (a, b):
            return None  # sizes matmul cannot broadcast
        shared = next(letters)
        # the size-1 side's letter where the other is larger, summed away
        own = next(letters) if None not in (a, b) and a != b else shared
        lhs = ("" if a is None else own if a == 1 else shared) + lhs
        rhs = ("" if b is None else own if b == 1 else shared) + rhs
        out = shared + out
    return f"{lhs}mk,{rhs}kn->{out}mn"


#: ``"...k,kn->...n"`` spelled out, by the input's number of dims (1 to 10).
_LINEAR = {
    ndim: f"{'abcdefghij'[: ndim - 1]}k,kn->{'abcdefghij'[: ndim - 1]}n"
    for ndim in range(1, 11)
}


def linear_equation(ndim: int) -> str | None:
    """The einsum of a ``(..., k)`` input of ``ndim`` dims by a ``(k, n)`` kernel."""
    return _LINEAR.get(ndim)


def local_dense(
    equation: str,
    x: Any,
    w: DTensor,
    b: DTensor | None = None,
    activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    scope: str = "elementwise",
) -> DTensor | None:
    """``activation(einsum(equation, x, w) + b)`` on local tensors, or None.

    A dense layer: a summed sharded letter is all-reduced before the bias (Megatron's
    row-parallel layer), every op between plain torch. None for a trace, mixed dtypes or
    meshes, no local form, a bias placed otherwise, an activation whose ``scope`` the
    output's sharding splits."""
    if torch.compiler.is_compiling() or not isinstance(w, DTensor):
        return None
    mesh = w.device_mesh
    if isinstance(x, DTensor):
        if not same_mesh(x.device_mesh, mesh):
            return None
        x_placements = tuple(x.placements)
    elif isinstance(x, torch.Tensor) and not x.requires_grad:
        x_placements = (Replicate(),) * mesh.ndim
    else:
        return None
    if x.dtype != w.dtype or not w.dtype.is_floating_point:
        return None
    found = planner.product(
        equation,
        (tuple(x.shape), tuple(w.shape)),
        (x_placements, tuple(w.placements)),
        tuple(mesh.shape),
    )
    if found is None:
        return None
    out, (x_grad, w_grad), summed = found
    reduced = without_partials(out)
    out_shape = _output_shape(equation, tuple(x.shape), tuple(w.shape))
    if b is not None:
        if not isinstance(b, DTensor) or b.dtype != w.dtype:
            return None
        if not same_mesh(b.device_mesh, mesh):
            return None
        b_plan = _bias_plan(out_shape, reduced, tuple(b.shape))
        if b_plan is None or b_plan[0] != tuple(b.placements):
            return None
    if activation is not None and not _scope_fits(scope, reduced, len(out_shape)):
        return None
    if any(p.is_partial() for p in x_grad):
        x = reducing_gradient(x)
    local = unwrap_local(x, x_grad) if isinstance(x, DTensor) else x
    if w.ndim == 2 and equation == linear_equation(x.ndim):
        # torch.matmul: fewer ops than einsum's permutes and bmm, both ways.
        y = torch.matmul(local, unwrap_local(w, w_grad))
    else:
        y = torch.einsum(equation, local, unwrap_local(w, w_grad))
    if summed:
        y = all_reduce_sum(y, mesh, summed)
    if b is not None:
        y = y + unwrap_local(b, b_plan[1])
    if activation is not None:
        y = activation(y)
    return wrap_local(y, mesh, reduced)


@functools.lru_cache(maxsize=512)
def _output_shape(
    equation: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...]
) -> tuple[int, ...]:
    # product() parsed it
    (x_letters, w_letters), output = planner.parse_equation(equation)
    sizes = dict(zip(x_letters, x_shape, strict=True))
    sizes.update(zip(w_letters, w_shape, strict=True))
    return tuple(sizes[letter] for letter in output)


@functools.lru_cache(maxsize=512)
def _bias_plan(
    out_shape: tuple[int, ...], out: Placements, bias_shape: tuple[int, ...]
) -> tuple[Placements, Placements] | None:
    """A bias's placements and its gradient's beside an output placed ``out`` (Partial
    where it broadcasts over a sharded dim), or None."""
    offset = len(out_shape) - len(bias_shape)
    if offset < 0 or any(
        size not in (1, out_shape[offset + i]) for i, size in enumerate(bias_shape)
    ):
        return None
    placements, grads = [], []
    for p in out:
        dim = p.dim - offset if p.is_shard() else -1
        if dim >= 0 and bias_shape[dim] != 1:
            placements.append(Shard(dim))
            grads.append(Shard(dim))
        else:
            placements.append(Replicate())
            grads.append(Partial() if p.is_shard() else Replicate())
    return tuple(placements), tuple(grads)


def _scope_fits(scope: str, placements: Placements, ndim: int) -> bool:
    """Whether an activation of ``scope`` (``elementwise``, ``last``) runs locally on an
    output so placed."""
    if scope == "elementwise":
        return True
    if scope == "last":
        return Shard(ndim - 1) not in placements
    return all(p.is_replicate() for p in placements)


class _LocalEinsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, equation: str, found: tuple, *operands: DTensor) -> DTensor:
        locals_ = [o._local_tensor for o in operands]
        ctx.equation, ctx.found = equation, found
        ctx.mesh = operands[0].device_mesh
        ctx.save_for_backward(*locals_)
        return wrap_local(torch.einsum(equation, *locals_), ctx.mesh, found.placements)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:
        mesh, needs, locals_ = ctx.mesh, ctx.needs_input_grad[2:], ctx.saved_tensors
        if not isinstance(grad, DTensor):
            grad = replicate(grad, mesh)
        # A Partial output's gradient is the full (replicated) gradient.
        g = redistributed(grad, without_partials(ctx.found.placements))._local_tensor
        equations = _grad_equations(ctx.equation)
        if equations is not None:
            found = iter(
                torch.einsum(equation, g, *(t for j, t in enumerate(locals_) if j != i))
                for i, equation in enumerate(equations)
                if needs[i]
            )
        else:  # a letter only one operand has, summed away: autograd's einsum
            with torch.enable_grad():
                leaves = [
                    t.detach().requires_grad_(need)
                    for t, need in zip(locals_, needs, strict=True)
                ]
                result = torch.einsum(ctx.equation, *leaves)
                wanted = [leaf for leaf in leaves if leaf.requires_grad]
                found = iter(torch.autograd.grad(result, wanted, g))
        grads = [
            wrap_local(next(found), mesh, placements) if need else None
            for need, placements in zip(needs, ctx.found.grads, strict=True)
        ]
        return (None, None, *grads)


@functools.lru_cache(maxsize=512)
def _grad_equations(equation: str) -> tuple[str, ...] | None:
    """Per operand, the einsum of its gradient (``"abk,kn->abn"``: ``("abn,kn->abk",
    "abn,abk->kn")``); None where a letter is only that operand's."""
    subscripts, output = planner.parse_equation(equation)  # product() parsed it already
    found = []
    for i, letters in enumerate(subscripts):
        others = [s for j, s in enumerate(subscripts) if j != i]
        if not set(letters) <= set(output).union(*others):
            return None
        found.append(",".join([output, *others]) + "->" + letters)
    return tuple(found)
