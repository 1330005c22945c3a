"""Einsum on DTensors as one local einsum per rank (pure torch, no Keras).

DTensor runs ``einsum`` as the ops it decomposes into (views, permutes, bmm),
each through sharding propagation; a view of a sharded tensor takes DTensor's
Python slow path. Where the placements say what each rank holds (every mesh
axis either replicated everywhere, or sharded on one subscript letter in every
operand that has it), the result is one local ``torch.einsum``: sharded on
that letter's output dim, or ``Partial("sum")`` when the letter is summed.
The backward is local too; an operand replicated on an axis where another is
sharded gets a ``Partial("sum")`` gradient, as DTensor's own einsum gives.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from keras_dtensor_fix.dtensor import replicate, wrap_local

__all__ = ["local_einsum", "local_matmul", "plan"]

Placements = tuple[Any, ...]


def local_einsum(equation: str, operands: Sequence[Any]) -> DTensor | None:
    """``torch.einsum(equation, *operands)`` computed on local shards, or None.

    None where the operands are not all DTensors of one float dtype on one
    mesh, under torch.compile, or where :func:`plan` finds no local form.
    """
    if len(operands) < 2 or torch.compiler.is_compiling():
        return None
    first = operands[0]
    if not isinstance(first, DTensor) or not first.dtype.is_floating_point:
        return None
    mesh = first.device_mesh
    for operand in operands[1:]:
        if (
            not isinstance(operand, DTensor)
            or (operand.device_mesh is not mesh and operand.device_mesh != mesh)
            or operand.dtype != first.dtype
        ):
            return None
    found = plan(
        equation,
        tuple(tuple(o.shape) for o in operands),
        tuple(tuple(o.placements) for o in operands),
        tuple(mesh.shape),
    )
    if found is None:
        return None
    return _LocalEinsum.apply(equation, found, *operands)


def local_matmul(x: Any, w: Any) -> DTensor | None:
    """``x @ w`` for a ``(..., k)`` by ``(k, n)`` product, as :func:`local_einsum`.

    Only where ``x`` has batch dims of its own (3 or more dims): DTensor's
    matmul flattens them with views, which take its slow path. A 2-d product
    is one cached ``mm`` for DTensor, cheaper than this.
    """
    if not (isinstance(x, DTensor) and isinstance(w, DTensor)):
        return None
    if w.ndim != 2 or not 3 <= x.ndim <= 10:
        return None
    batch = "abcdefghij"[: x.ndim - 1]
    return local_einsum(f"{batch}k,kn->{batch}n", (x, w))


def _parse(equation: str) -> tuple[list[str], str] | None:
    """Operand subscripts and output of an explicit einsum equation, or None.

    None for an implicit output (no ``->``) or an ellipsis.
    """
    equation = equation.replace(" ", "")
    if "..." in equation or "->" not in equation:
        return None
    inputs, output = equation.split("->")
    return inputs.split(","), output


@functools.lru_cache(maxsize=512)
def plan(
    equation: str,
    shapes: tuple[tuple[int, ...], ...],
    placements: tuple[Placements, ...],
    mesh_shape: tuple[int, ...],
) -> tuple[Placements, tuple[Placements, ...]] | None:
    """Output placements and each operand's gradient placements, or None.

    None for what has no local form here: an ellipsis, a repeated or
    broadcast letter, Partial or uneven or strided shards, two letters sharded
    on one mesh axis, or a sharded letter that some operand holds unsharded.
    """
    parsed = _parse(equation)
    if parsed is None:
        return None
    subscripts, output = parsed
    if len(subscripts) != len(shapes) or len(set(output)) != len(output):
        return None
    sizes: dict[str, int] = {}
    for letters, shape in zip(subscripts, shapes, strict=True):
        if len(letters) != len(shape) or len(set(letters)) != len(letters):
            return None
        for letter, size in zip(letters, shape, strict=True):
            if sizes.setdefault(letter, size) != size:
                return None  # a broadcast letter: its gradient needs a sum
    out: list[Any] = []
    grads: list[list[Any]] = [[] for _ in subscripts]
    for axis, size in enumerate(mesh_shape):
        holders: dict[str, list[int]] = {}
        for i, letters in enumerate(subscripts):
            placement = placements[i][axis]
            if placement.is_replicate():
                continue
            if type(placement) is not Shard or not 0 <= placement.dim < len(letters):
                return None
            if shapes[i][placement.dim] % size:
                return None
            holders.setdefault(letters[placement.dim], []).append(i)
        if not holders:
            out.append(Replicate())
            for grad in grads:
                grad.append(Replicate())
            continue
        if len(holders) > 1:
            return None
        ((letter, sharded),) = holders.items()
        if any(letter in s and i not in sharded for i, s in enumerate(subscripts)):
            return None
        out.append(Shard(output.index(letter)) if letter in output else Partial())
        for i, grad in enumerate(grads):
            grad.append(placements[i][axis] if i in sharded else Partial())
    return tuple(out), tuple(tuple(g) for g in grads)


class _LocalEinsum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, equation: str, found: tuple, *operands: DTensor) -> DTensor:
        locals_ = [o._local_tensor for o in operands]
        ctx.equation, ctx.found = equation, found
        ctx.mesh = operands[0].device_mesh
        ctx.save_for_backward(*locals_)
        result = torch.einsum(equation, *locals_)
        return wrap_local(result, ctx.mesh, found[0])

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple:
        out_placements, grad_placements = ctx.found
        mesh = ctx.mesh
        # A Partial output's gradient is the full (replicated) gradient.
        want = tuple(Replicate() if p.is_partial() else p for p in out_placements)
        if not isinstance(grad, DTensor):
            grad = replicate(grad, mesh)
        if tuple(grad.placements) != want:
            grad = grad.redistribute(mesh, want)
        needs = ctx.needs_input_grad[2:]
        locals_ = ctx.saved_tensors
        g = grad._local_tensor
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
            for need, placements in zip(needs, grad_placements, strict=True)
        ]
        return (None, None, *grads)


@functools.lru_cache(maxsize=512)
def _grad_equations(equation: str) -> tuple[str, ...] | None:
    """Per operand, the einsum of the output gradient and the other operands.

    ``"abk,kn->abn"`` gives ``("abn,kn->abk", "abn,abk->kn")``. None where an
    operand has a letter that neither the output nor another operand has.
    """
    subscripts, output = _parse(equation)  # plan() parsed it already
    found = []
    for i, letters in enumerate(subscripts):
        others = [s for j, s in enumerate(subscripts) if j != i]
        if not set(letters) <= set(output).union(*others):
            return None
        found.append(",".join([output, *others]) + "->" + letters)
    return tuple(found)
