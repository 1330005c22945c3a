"""A layer's whole computation on each rank's local tensors, where
:func:`.planner.region` allows it; gradients exact (each rank's backward is its
piece's)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.tensor import DTensor

from keras_dtensor_fix.dtensor import planner
from keras_dtensor_fix.dtensor.local import unwrap_local


def local_region(
    values: Sequence[Any], mixes: frozenset[int] | None
) -> tuple[Any, tuple, list[Any]] | None:
    """``(mesh, placements, locals)`` when the computation may run locally
    (:func:`.planner.region`), else None."""
    found = planner.region(values, mixes)
    if found is None:
        return None
    mesh, placements = found
    local = [unwrap_local(v) if isinstance(v, DTensor) else v for v in values]
    return mesh, placements, local
