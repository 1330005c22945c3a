"""Placements of a DTensor on its mesh: compare, move, share, reduce."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate

from keras_dtensor_fix.dtensor.collectives import all_reduce_copy
from keras_dtensor_fix.dtensor.spec import INTERNALS, cached_spec, copy_spec


def same_mesh(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same DeviceMesh (identity, else equality).

    Traced, yes: dynamo's identity test on a mesh can change between a frame's analysis
    and its restart after a graph break, and a Keras distribution has one mesh, which
    the eager steps checked."""
    if torch.compiler.is_compiling():
        return True
    return a is b or a == b


class _Relabel(torch.autograd.Function):
    """``value`` with new ``placements``, its gradient back as ``grad_placements``: on
    one-rank mesh axes, the same local tensor (where ``redistribute`` would issue a
    collective over a one-rank group); Partial("sum") to Replicate (``summed``: its
    mesh axes), plain c10d all-reduces, cheaper on gloo than the functional
    collectives."""

    @staticmethod
    def forward(
        ctx: Any,
        value: DTensor,
        placements: tuple,
        grad_placements: tuple,
        summed: list,
    ) -> DTensor:
        ctx.placements = grad_placements
        mesh, local = value.device_mesh, value._local_tensor
        if summed:
            local = all_reduce_copy(local, mesh, summed)
        else:
            local = local.view_as(local)
        spec = copy_spec(cached_spec(mesh, placements, value._spec.tensor_meta))
        return DTensor(local, spec, requires_grad=value.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None, None]:
        if isinstance(grad, DTensor):
            grad = redistributed(grad, ctx.placements)
        return grad, None, None, None


def redistributed(value: DTensor, placements: Sequence[Any]) -> DTensor:
    """``value.redistribute`` to ``placements``, a relabel only on one-rank axes."""
    placements = tuple(placements)
    have = tuple(value.placements)
    if have == placements:
        return value
    mesh = value.device_mesh
    if INTERNALS is None:
        return value.redistribute(mesh, placements)
    # ``have`` with the wanted placement on every mesh axis of one rank
    relabelled = tuple(
        w if n == 1 else h for h, w, n in zip(have, placements, mesh.shape, strict=True)
    )
    if relabelled != have:
        if torch.compiler.is_compiling():
            # Traced (a compiled backward of an eager _Relabel too):
            # to_local/from_local relabel; redistribute refuses "to Partial".
            value = _from_local(value.to_local(), value, mesh, relabelled)
        else:
            value = _Relabel.apply(value, relabelled, have, [])
    if relabelled != placements:
        value = value.redistribute(mesh, placements)
    return value


def effective(value: DTensor) -> tuple:
    """``value``'s placements, Replicate on its mesh axes of one rank."""
    sizes = value.device_mesh.shape
    return tuple(
        Replicate() if n == 1 else p
        for p, n in zip(value.placements, sizes, strict=True)
    )


def one_rank_replicated(value: Any) -> Any:
    """``value`` labelled Replicate on its one-rank mesh axes (no data moves): a
    compiled graph guards on placements, and one label keeps one graph."""
    if not isinstance(value, DTensor):
        return value
    return redistributed(value, effective(value))


def on_mesh(value: Any, mesh: Any) -> Any:
    """``value`` on the ``mesh`` object where it sits on an equal one.

    Sharding propagation's caches may hand back an earlier equal mesh; a compiled graph
    guards on the mesh's identity and would compile again."""
    if (
        not isinstance(value, DTensor)
        or value.device_mesh is mesh
        or value.device_mesh != mesh
    ):
        return value
    return _from_local(value._local_tensor, value, mesh, value.placements)


def _from_local(local: Any, like: DTensor, mesh: Any, placements: Any) -> DTensor:
    """``local`` as a DTensor of ``like``'s global shape and stride."""
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=like.shape, stride=like.stride()
    )


def placed(value: DTensor, placements: Sequence[Any]) -> DTensor:
    """:func:`redistributed`, once per activation and placements.

    An activation keeps what it was redistributed to, so its readers share one
    redistribution and its backward (a loss and an accuracy gather the logits once; Q, K
    and V sum their gradients before one all-gather); inductor does not merge
    collectives either. A result without gradient serves only callers without; one made
    before an in-place change is not reused; leaves and views of leaves are never kept.
    """
    placements = tuple(placements)
    if value.is_leaf or views_leaf(value):
        return redistributed(value, placements)
    grad = torch.is_grad_enabled()
    # Dynamo reads no version counter; a traced activation is not changed in
    # place between its readers here (Keras's layers return new tensors).
    version = None if torch.compiler.is_compiling() else value._version
    kept = getattr(value, _PLACED, None)
    if kept is None:
        kept = []
        setattr(value, _PLACED, kept)
    for have, at, with_grad, result in kept:
        if have == placements and at == version and (with_grad or not grad):
            return result
    result = redistributed(value, placements)
    # It replaces what it serves better: a stale one, or one without gradient.
    kept[:] = [entry for entry in kept if entry[0] != placements]
    kept.append((placements, version, grad, result))
    return result


def views_leaf(value: torch.Tensor) -> bool:
    """Whether ``value`` is a view of a leaf: the optimizer writes the weight in place
    unseen by the view's version counter, so nothing is kept on it."""
    base = value._base
    return base is not None and base.is_leaf


def kept_detached(value: Any) -> list[tuple[bool, Any]]:
    """What :func:`placed` kept on ``value``, detached: a compiled region returns them
    beside ``value`` for eager readers (:func:`keep`)."""
    kept = getattr(value, _PLACED, None) or []
    # Placements do not leave a graph as themselves: :func:`keep` reads them
    # off each result.
    return [(grad, result.detach()) for _, _, grad, result in kept]


def keep(value: Any, entries: list[tuple[bool, Any]]) -> None:
    """Give ``value`` what :func:`kept_detached` took from a region's output (no
    gradient path: :func:`forget_kept` before a differentiated reader)."""
    if entries:
        version = value._version
        kept = [(tuple(r.placements), version, grad, r) for grad, r in entries]
        setattr(value, _PLACED, kept)


def forget_kept(value: Any) -> None:
    """Drop what :func:`placed` kept on ``value``."""
    if getattr(value, _PLACED, None) is not None:
        setattr(value, _PLACED, None)


#: The attribute :func:`placed` keeps an activation's redistributions in.
_PLACED = "_keras_dtensor_fix_placed"


def is_replicated(value: DTensor) -> bool:
    """Whether ``value`` holds the same full value on every rank."""
    return all(p.is_replicate() for p in value.placements)


def without_partials(placements: Sequence[Any]) -> tuple:
    """``placements`` with every partial one (a pending reduction) replicated."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def reduce_partial(value: Any) -> Any:
    """``value`` with its ``Partial`` mesh axes reduced to ``Replicate`` (Megatron's
    row-parallel output); eager sums by plain c10d all-reduces."""
    if not isinstance(value, DTensor):
        return value
    placements = tuple(value.placements)
    if not any(p.is_partial() for p in placements):
        return value
    reduced = without_partials(placements)
    sizes = value.device_mesh.shape
    # A one-rank axis holds its sum already: redistributed relabels it.
    axes = [a for a, p in enumerate(placements) if p.is_partial() and sizes[a] > 1]
    if (
        axes
        and INTERNALS is not None
        and not torch.compiler.is_compiling()
        and all(type(placements[a]) is Partial for a in axes)
        and all(placements[a].reduce_op == "sum" for a in axes)
    ):
        return _Relabel.apply(value, reduced, reduced, axes)
    return redistributed(value, reduced)


def reduce_masked(value: Any) -> Any:
    """``value`` reduced at once if it is partial with a one-shot mask: torch releases a
    ``_MaskPartial``'s mask at its first reduction, so a second reader of the unreduced
    value failed."""
    if isinstance(value, DTensor) and any(
        p.is_partial() and type(p) is not Partial for p in value.placements
    ):
        return _ReduceMasked.apply(value, without_partials(value.placements))
    return value


class _ReduceMasked(torch.autograd.Function):
    """Reduce a masked partial value; its gradient goes back replicated (torch has no
    Partial-to-mask redistribution)."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, reduced: tuple) -> DTensor:
        return value.redistribute(value.device_mesh, reduced)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        return reduce_partial(grad), None
