"""What the patches ask of Keras at run time: the active distribution, compiling."""

from __future__ import annotations

import sys
from typing import Any


def model_parallel() -> Any | None:
    """The active Keras distribution when it shards with DTensors, else None.

    ``DataParallel`` keeps plain tensors (DDP) and is left alone.
    """
    distribution_lib = sys.modules.get("keras.src.distribution.distribution_lib")
    if distribution_lib is None or not hasattr(distribution_lib, "DataParallel"):
        return None  # not (fully) imported yet: no distribution can be set
    dist = distribution_lib.distribution()
    if dist is None or isinstance(dist, distribution_lib.DataParallel):
        return None
    return dist


def compiling() -> bool:
    """Whether torch.compile (dynamo) is tracing the current frame."""
    import torch

    return bool(torch.compiler.is_compiling())


#: Non-empty once a ModelParallel step function is compiled in this process.
COMPILED_STEPS: list[bool] = []


def note_compiled_step() -> None:
    """Record that a compiled ModelParallel step exists (batches go static)."""
    if not COMPILED_STEPS:
        COMPILED_STEPS.append(True)
