"""The DTensorSpec cache: building a spec costs more than the rest of a small op.

:func:`~keras_dtensor_fix.dtensor.local.wrap_local` and the relabelling and
reducing autograd ops of :mod:`.placement` build DTensors from cached specs
(``_spec``) and give each its own shallow copy (``_copy``). ``_SPEC`` holds
torch's spec internals, or ``None`` on a torch that moved them (callers then
take torch's public, slower path); it is fixed at import.
"""

from __future__ import annotations

import copy
from typing import Any

#: DTensorSpecs by what they are built from: building one costs more than the
#: rest of a small op. Each DTensor gets its own (shallow) copy.
_SPECS: dict[tuple, Any] = {}


def _copy(spec: Any, new: Any = object.__new__) -> Any:
    """A shallow copy of a DTensorSpec: what ``copy.copy`` does, 8x cheaper."""
    state = getattr(spec, "__dict__", None)
    if state is None:  # a torch with slotted specs
        return copy.copy(spec)
    clone = new(spec.__class__)
    clone.__dict__.update(state)
    return clone


def _remember(key: tuple, spec: Any) -> Any:
    if len(_SPECS) >= 1024:
        _SPECS.clear()
    _SPECS[key] = spec
    return spec


def _spec(mesh: Any, placements: tuple, meta: Any) -> Any:
    """The (cached) DTensorSpec of ``mesh``, ``placements`` and a TensorMeta."""
    key = (mesh, placements, meta)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _remember(key, _SPEC[0](mesh, placements, tensor_meta=meta))
    return spec


def _spec_internals() -> tuple[Any, Any, Any] | None:
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._utils import compute_global_tensor_info
    except ImportError:  # pragma: no cover - torch moved them
        return None
    return DTensorSpec, TensorMeta, compute_global_tensor_info


_SPEC = _spec_internals()
