"""A layer's whole computation on each rank's local tensors.

:func:`.planner.region` decides: all operands replicated (mesh axes of one
rank count as replicated), or split alike only on dims the computation does
not read across (a norm's feature axis, a rotary embedding's sequence and
feature axes stay whole). Each rank then computes its own piece, and its
result is wrapped once. Gradients are exact: each rank's local backward is the
backward of its own piece.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.distributed.tensor import DTensor

from keras_dtensor_fix.dtensor import planner
from keras_dtensor_fix.dtensor.local import unwrap_local


def local_region(
    values: Sequence[Any], mixes: frozenset[int] | None
) -> tuple[Any, tuple, list[Any]] | None:
    """``(mesh, placements, locals)`` when the computation may run locally.

    ``values`` are the leaves of the call's arguments; ``mixes`` the dims the
    computation reads across (None: unknown, every DTensor must be whole).
    The locals are ``unwrap_local``'s (an autograd op where a gradient is
    wanted); ``placements`` are what a result with the operands' shape gets.
    None where :func:`.planner.region` finds no local form.
    """
    found = planner.region(values, mixes)
    if found is None:
        return None
    mesh, placements = found
    local = [unwrap_local(v) if isinstance(v, DTensor) else v for v in values]
    return mesh, placements, local
