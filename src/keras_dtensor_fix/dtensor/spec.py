"""The DTensorSpec cache: building a spec costs more than the rest of a small op.
``INTERNALS`` holds torch's spec internals, or None on a torch that moved them (callers
then take the public path)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor

#: DTensorSpecs by what they are built from; each DTensor gets its own shallow copy.
SPECS: dict[tuple, Any] = {}


def copy_spec(spec: Any, new: Any = object.__new__) -> Any:
    """A shallow copy of a DTensorSpec: what ``copy.copy`` does, cheaper."""
    state = getattr(spec, "__dict__", None)
    if state is None:  # a torch with slotted specs
        return copy.copy(spec)
    clone = new(spec.__class__)
    clone.__dict__.update(state)
    return clone


def remember(key: tuple, spec: Any) -> Any:
    if len(SPECS) >= 1024:
        SPECS.clear()
    SPECS[key] = spec
    return spec


def cached_spec(mesh: Any, placements: tuple, meta: Any) -> Any:
    """The cached DTensorSpec of ``mesh``, ``placements`` and a TensorMeta, keyed by the
    mesh's identity (dynamo guards on it)."""
    key = (id(mesh), placements, meta)
    spec = SPECS.get(key)
    if spec is None:
        spec = remember(key, INTERNALS[0](mesh, placements, tensor_meta=meta))
    return spec


def forget_meshes() -> None:
    """Empty torch's sharding-propagation caches when a new torch mesh is made.

    They hand back the first equal mesh they met: a compiled joint graph then found the
    older mesh in a tangent only and failed to partition ("Node tangents_2 was invalid,
    but is output")."""
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        getattr(getattr(propagator, cached, None), "cache_clear", lambda: None)()
    getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", lambda: None)()
    SPECS.clear()


def _spec_internals() -> tuple[Any, Any, Any] | None:
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._utils import compute_global_tensor_info
    except ImportError:  # pragma: no cover - torch moved them
        return None
    return DTensorSpec, TensorMeta, compute_global_tensor_info


INTERNALS = _spec_internals()
