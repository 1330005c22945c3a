"""The DTensorSpec cache: building a spec costs more than the rest of a small op.

:func:`~keras_dtensor_fix.dtensor.local.wrap_local` and the relabelling and
reducing autograd ops of :mod:`.placement` build DTensors from cached specs
(``cached_spec``) and give each its own shallow copy (``copy_spec``).
``INTERNALS`` holds torch's spec internals, or ``None`` on a torch that moved
them (callers then take torch's public, slower path); it is fixed at import.
"""

from __future__ import annotations

import copy
from typing import Any

#: DTensorSpecs by what they are built from: building one costs more than the
#: rest of a small op. Each DTensor gets its own (shallow) copy.
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
    """The (cached) DTensorSpec of ``mesh``, ``placements`` and a TensorMeta.

    Keyed by the mesh's identity: an equal mesh of another distribution
    (DeviceMesh compares by value) gets a spec of its own, which dynamo's
    guards on a DTensor's mesh object then find. The spec holds its mesh, so
    an id in the cache is never reused.
    """
    key = (id(mesh), placements, meta)
    spec = SPECS.get(key)
    if spec is None:
        spec = remember(key, INTERNALS[0](mesh, placements, tensor_meta=meta))
    return spec


def forget_meshes() -> None:
    """Empty torch's sharding-propagation caches (Python's and the C++ fast
    path's), called when a new torch mesh is made.

    They match a mesh by value and hand back the output spec of the first
    equal mesh they met: after an earlier distribution, an op's output holds
    that older mesh object. Compiled, AOT autograd's joint graph then finds
    the older mesh only in the tangent built from that output, and a forward
    output that refers to a tangent fails to partition ("Node tangents_2 was
    invalid, but is output"); dynamo also guards on the mesh's identity.
    """
    import torch

    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return
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
