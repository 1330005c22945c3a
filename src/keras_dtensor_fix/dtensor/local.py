"""Crossing between local tensors and DTensors, cheaper than torch's own: specs cached
(:mod:`.spec`), smaller autograd ops, Megatron's "f"."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from keras_dtensor_fix.dtensor import planner
from keras_dtensor_fix.dtensor.placement import (
    forget_kept,
    redistributed,
    reduce_partial,
    views_leaf,
)
from keras_dtensor_fix.dtensor.spec import (
    INTERNALS,
    SPECS,
    cached_spec,
    copy_spec,
    remember,
)


def wrap_local(value: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> DTensor:
    """``DTensor.from_local(value, mesh, placements, run_check=False)``, cheaper: from a
    cached spec, with a smaller autograd op (none without gradient). A Partial value
    with gradient, a negative dim and a trace take ``from_local``."""
    if value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    placements = tuple(placements)
    grad = value.requires_grad and torch.is_grad_enabled()
    if (
        INTERNALS is None
        or torch.compiler.is_compiling()
        or any(isinstance(p, Shard) and p.dim < 0 for p in placements)
        or (grad and any(p.is_partial() for p in placements))
    ):
        return DTensor.from_local(value, mesh, placements, run_check=False)
    # by the mesh's identity, as cached_spec
    key = (id(mesh), placements, value.shape, value.stride(), value.dtype)
    spec = SPECS.get(key)
    if spec is None:
        _, meta_class, global_info = INTERNALS
        shape, stride = global_info(value, mesh, placements)
        meta = meta_class(torch.Size(shape), tuple(stride), value.dtype)
        spec = remember(key, cached_spec(mesh, placements, meta))
    if grad:
        return _WrapLocal.apply(value, spec)
    return DTensor(value.view_as(value), copy_spec(spec), requires_grad=False)


class _WrapLocal(torch.autograd.Function):
    """``from_local``'s autograd op for Replicate and Shard placements."""

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, spec: Any) -> DTensor:
        ctx.spec = spec
        # As from_local: the wrapper's requires_grad follows the local tensor's.
        return DTensor(
            value.view_as(value), copy_spec(spec), requires_grad=value.requires_grad
        )

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if isinstance(grad, DTensor):
            grad = redistributed(grad, ctx.spec.placements)._local_tensor
        return grad, None


def unwrap_local(
    value: DTensor, grad_placements: Sequence[Any] | None = None
) -> torch.Tensor:
    """``value.to_local(grad_placements=...)``, its gradient wrapped from a cached spec;
    a Partial value and a trace take ``to_local``."""
    if not (value.requires_grad and torch.is_grad_enabled()):
        return value._local_tensor.view_as(value._local_tensor)
    if (
        INTERNALS is None
        or torch.compiler.is_compiling()
        or any(p.is_partial() for p in value.placements)
    ):
        return value.to_local(grad_placements=grad_placements)
    return _UnwrapLocal.apply(value, tuple(grad_placements or value.placements))


def reducing_gradient(value: Any) -> Any:
    """``value``, whose gradient is summed over its Partial mesh axes once.

    Megatron's "f": a replicated activation read by column-parallel products gets a
    Partial gradient from each; autograd adds them and this op's backward all-reduces
    the total once. Handed on as Partial, every earlier reader of the residual stream
    reduced its own copy. Cached on the value (its readers share it); traced, a
    ``redistribute`` to the same placements."""
    if not _reducible(value) or not torch.is_grad_enabled() or INTERNALS is None:
        return value
    kept = not views_leaf(value)  # a view of a leaf may outlive the step: stale
    reducing = getattr(value, _REDUCING, None) if kept else None
    if reducing is None:
        if torch.compiler.is_compiling():
            reducing = value.redistribute(value.device_mesh, value.placements)
        else:
            reducing = _ReduceGradient.apply(value)
        if kept:
            setattr(value, _REDUCING, reducing)
    return reducing


def _reducible(value: Any) -> bool:
    """An activation (no leaf; dynamo reads no grad_fn) that needs a gradient and
    holds no pending sum."""
    return (
        isinstance(value, DTensor)
        and not value.is_leaf
        and value.requires_grad
        and not any(p.is_partial() for p in value.placements)
    )


def reducing_input(value: Any) -> Any:
    """:func:`reducing_gradient` of a compiled region's input, kept on its own result
    (on an input from outside the graph it would be an extra output)."""
    if not _reducible(value):
        return value
    reducing = value.redistribute(value.device_mesh, value.placements)
    setattr(reducing, _REDUCING, reducing)
    return reducing


def without_kept(value: Any) -> Any:
    """A compiled region's output without what readers kept on it: kept, it would be one
    more graph output that gets no gradient (pytorch/pytorch#173123)."""
    if isinstance(value, DTensor):
        forget_kept(value)
        if getattr(value, _REDUCING, None) is not None:
            setattr(value, _REDUCING, None)
    return value


#: The attribute :func:`reducing_gradient` keeps an activation's op in.
_REDUCING = "_keras_dtensor_fix_reducing"


class _ReduceGradient(torch.autograd.Function):
    """Identity forward; the gradient's Partial axes summed in backward."""

    @staticmethod
    def forward(ctx: Any, value: DTensor) -> DTensor:
        local = value._local_tensor
        return DTensor(local.view_as(local), copy_spec(value._spec), requires_grad=True)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        return reduce_partial(grad)


class _UnwrapLocal(torch.autograd.Function):
    """``to_local``'s autograd op for Replicate and Shard placements."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, placements: tuple) -> torch.Tensor:
        ctx.mesh, ctx.placements = value.device_mesh, placements
        ctx.set_materialize_grads(False)
        local = value._local_tensor
        # A fresh tensor: autograd writes its metadata into the result.
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if grad is not None and not isinstance(grad, DTensor):
            grad = wrap_local(grad, ctx.mesh, ctx.placements)
        return grad, None


def replicate(value: torch.Tensor, mesh: Any) -> DTensor:
    """Wrap a plain tensor holding the full value as a Replicate DTensor on ``mesh``."""
    return wrap_local(value, mesh, [Replicate()] * mesh.ndim)


def zero_gradients_if_unused(values: Sequence[Any]) -> list[Any]:
    """``values``, each DTensor's missing gradient zeros of its spec.

    Autograd fills an output that got no gradient with plain zeros, which a compiled
    backward refuses (torch 2.13, pytorch/pytorch#173123). One autograd op for all."""
    values = list(values)
    at = [i for i, v in enumerate(values) if isinstance(v, DTensor) and v.requires_grad]
    if not at:
        return values
    for i, value in zip(at, _ZeroIfUnused.apply(*(values[i] for i in at)), strict=True):
        values[i] = value
    return values


class _ZeroIfUnused(torch.autograd.Function):
    """Identity forward; a missing gradient becomes zeros of its DTensor's spec."""

    @staticmethod
    def forward(ctx: Any, *values: DTensor) -> tuple[DTensor, ...]:
        ctx.set_materialize_grads(False)
        ctx.specs = [copy_spec(v._spec) for v in values]
        ctx.locals = [(v._local_tensor.shape, v._local_tensor.dtype) for v in values]
        ctx.device = values[0]._local_tensor.device
        return tuple(
            DTensor(v._local_tensor.view_as(v._local_tensor), spec, requires_grad=True)
            for v, spec in zip(values, ctx.specs, strict=True)
        )

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        filled = []
        described = zip(grads, ctx.specs, ctx.locals, strict=True)
        for grad, spec, (shape, dtype) in described:
            if grad is None:
                zeros = torch.zeros(shape, dtype=dtype, device=ctx.device)
                grad = DTensor(zeros, copy_spec(spec), requires_grad=False)
            filled.append(grad)
        return tuple(filled)


def local_region(
    values: Sequence[Any], mixes: frozenset[int] | None
) -> tuple[Any, tuple, list[Any]] | None:
    """``(mesh, placements, locals)`` when a layer's computation may run on each
    rank's local tensors (:func:`.planner.region`; each rank's backward is its
    piece's), else None."""
    found = planner.region(values, mixes)
    if found is None:
        return None
    mesh, placements = found
    local = [unwrap_local(v) if isinstance(v, DTensor) else v for v in values]
    return mesh, placements, local
