"""Find a DTensor among arguments and promote plain tensors next to it (only as the full
value: a shard-like tensor raises :class:`PromotionError`), and DTensor's implicit
replication switch."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map_only

from keras_dtensor_fix.dtensor import planner
from keras_dtensor_fix.dtensor.local import replicate, wrap_local
from keras_dtensor_fix.dtensor.placement import redistributed, same_mesh


class PromotionError(RuntimeError):
    """A plain tensor met a DTensor and could not be promoted safely."""

    def __init__(self, problem: str, hint: str = "") -> None:
        super().__init__(f"{problem} {hint}".strip())
        self.problem = problem
        self.hint = hint


def implicit_replication() -> bool:
    """Whether DTensor treats a plain tensor operand as replicated (per thread)."""
    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def set_implicit_replication(on: bool) -> None:
    """Turn DTensor's implicit replication on or off (this thread; in C, no Python cost
    per op)."""
    DTensor._op_dispatcher._allow_implicit_replication = bool(on)


def _is_plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def _one_level(values: Iterable[Any]) -> Iterator[Any]:
    """``values`` with each list or tuple among them opened (one level)."""
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


def find_dtensor(values: Iterable[Any]) -> DTensor | None:
    """Return the first DTensor in ``values`` or one level inside a list/tuple."""
    return next((v for v in _one_level(values) if isinstance(v, DTensor)), None)


def has_plain_tensor(values: Iterable[Any]) -> bool:
    """Whether ``values`` (or lists inside) hold a non-scalar plain tensor."""
    return any(_is_plain(v) and v.ndim for v in _one_level(values))


def replicate_plain(tree: Any, mesh: Any) -> Any:
    """Each non-scalar plain tensor in ``tree`` as a Replicate DTensor on ``mesh``."""

    def one(value: torch.Tensor) -> torch.Tensor:
        return replicate(value, mesh) if _is_plain(value) and value.ndim else value

    return tree_map_only(torch.Tensor, one, tree)


def describe(value: Any) -> str:
    """A short description of a tensor for error messages: shape, dtype, placements."""
    if isinstance(value, DTensor):
        placements = ", ".join(str(p) for p in value.placements)
        local = tuple(value._local_tensor.shape)
        return (
            f"DTensor(shape={tuple(value.shape)}, local={local}, "
            f"dtype={value.dtype}, placements=({placements}))"
        )
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return type(value).__name__


def replicated_locals(values: Sequence[Any]) -> tuple[Any, list[Any]] | None:
    """The mesh and ``values`` with each DTensor as its local tensor, where every
    operand is whole (:func:`.planner.replicated`), nothing needs a gradient and nothing
    is traced; else None."""
    if torch.compiler.is_compiling():
        return None
    mesh = planner.replicated(values, gradients=False)
    if mesh is None:
        return None
    return mesh, [v._local_tensor if isinstance(v, DTensor) else v for v in values]


def replicate_result(result: Any, mesh: Any) -> Any:
    """Each tensor in ``result`` (lists and tuples inside) as a Replicate DTensor."""
    if _is_plain(result):
        return replicate(result, mesh)
    if isinstance(result, (list, tuple)):
        return type(result)(replicate_result(r, mesh) for r in result)
    return result


def local_shard_dim(value: torch.Tensor, partner: DTensor) -> int | None:
    """The dim where ``value`` has the partner's local size, not its global one: likely
    one rank's shard, wrong to promote as Replicate."""
    if value.ndim != partner.ndim:
        return None
    local_shape = partner._local_tensor.shape
    for placement in partner.placements:
        if isinstance(placement, Shard):
            dim = placement.dim % partner.ndim
            size = value.shape[dim]
            if size != 1 and size == local_shape[dim] != partner.shape[dim]:
                return dim
    return None


def promote_args(
    values: Sequence[Any], partner: DTensor, *, op: str = "op", elementwise: bool = True
) -> list[Any]:
    """Every non-scalar plain tensor in ``values`` (and one level of lists) as a
    Replicate DTensor beside ``partner``."""

    def promote(value: Any) -> Any:
        if not (_is_plain(value) and value.ndim):
            return value
        dim = local_shard_dim(value, partner) if elementwise else None
        if dim is not None:
            raise PromotionError(
                f"{op}: a plain {describe(value)} meets {describe(partner)}. Its "
                f"dim {dim} has the size of one rank's shard "
                f"({value.shape[dim]}), not the global size "
                f"({partner.shape[dim]}), so it looks like a per-rank shard;",
                "promoting it as the full (replicated) value would be wrong. "
                "Distribute it first: keras.distribution.distribute_tensor(x, "
                "layout) for a full value, or the backend's "
                "distribute_data_input(x, layout) for a per-process batch.",
            )
        return replicate(value, partner.device_mesh)

    return [
        type(v)(promote(item) for item in v)
        if isinstance(v, (list, tuple)) and any(_is_plain(i) and i.ndim for i in v)
        else promote(v)
        for v in values
    ]


def to_placements(value: torch.Tensor, like: DTensor) -> DTensor:
    """``value`` with ``like``'s mesh and placements (a plain tensor of its global shape
    is the full value, of its local shape this rank's shard)."""
    mesh, placements = like.device_mesh, tuple(like.placements)
    if isinstance(value, DTensor):
        if not same_mesh(value.device_mesh, mesh):
            return value.redistribute(mesh, placements)
        return redistributed(value, placements)
    if tuple(value.shape) == tuple(like.shape):
        return replicate(value, mesh).redistribute(mesh, placements)
    if tuple(value.shape) == tuple(like._local_tensor.shape):
        return wrap_local(value, mesh, placements)
    raise PromotionError(
        f"a plain {describe(value)} cannot take the layout of {describe(like)}: "
        "its shape is neither the global nor the local shape."
    )
