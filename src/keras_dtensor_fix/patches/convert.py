"""Conversions: ``convert_to_numpy`` gathers, ``convert_to_tensor`` traces.

Nightlies before 2026-10-27 return each process's local shard from
``get_weights()`` and ``predict()``. ``convert_to_tensor`` reads
``np.array(x).dtype``, which dynamo cannot trace: every numpy value a
compiled step converts (keras-hub's attention scale) split the graph.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.ops.values import walk
from keras_dtensor_fix.saving import one_writer


def _convert_to_numpy(wrapped, instance, args, kwargs):
    def full(value: Any, _layout: Any) -> Any:
        if isinstance(value, targets.keras_object("Variable")):
            value = value.value
        if isinstance(value, DTensor):
            found = one_writer.gathered(value)  # a save's writer: no collective
            return value.detach().full_tensor() if found is None else found
        return value

    if args:
        args = (walk(args[0], None, full),) + args[1:]
    return wrapped(*args, **kwargs)


def _convert_to_tensor_in(core: types.ModuleType) -> Any:
    """The ``convert_to_tensor`` wrapper of ``core`` (its helpers read once: dynamo
    would trace each lookup again)."""
    get_device = getattr(core, "get_device", None)
    to_torch_dtype = getattr(core, "to_torch_dtype", None)

    def convert_to_tensor(wrapped, instance, args, kwargs):
        # Traced, a numpy value goes in as torch.as_tensor of it (same dtype).
        if args and torch.compiler.is_compiling():
            if isinstance(args[0], (np.ndarray, np.generic)):
                tensor = torch.as_tensor(args[0])
                if tensor.dtype == torch.uint32:  # as Keras: torch lacks uint32 ops
                    tensor = tensor.to(torch.int64)
                args = (tensor,) + args[1:]
            elif isinstance(args[0], DTensor) and _unchanged(
                args, kwargs, get_device, to_torch_dtype
            ):
                return args[0]
        return wrapped(*args, **kwargs)

    return convert_to_tensor


def _unchanged(args: tuple, kwargs: dict, get_device: Any, to_torch_dtype: Any) -> bool:
    """Whether Keras's conversion would return DTensor ``args[0]`` as is
    (traced, ``x.to`` makes a new object, losing what ``dtensor.placed`` keeps)."""
    if get_device is None or to_torch_dtype is None:
        return False
    if len(args) > 2 or kwargs.get("sparse") or kwargs.get("ragged"):
        return False
    value = args[0]
    dtype = args[1] if len(args) > 1 else kwargs.get("dtype")
    if dtype is not None and to_torch_dtype(dtype) != value.dtype:
        return False
    return value.device == torch.device(get_device())


def patches(module: types.ModuleType) -> list[Patch]:
    name, to_tensor = module.__name__, _convert_to_tensor_in(module)
    by_name, star = targets.ALIASES["core_by_name"], targets.ALIASES["core_star"]
    return [
        # traced: a compiled token step (gate shut) converts too
        Patch(name, "convert_to_tensor", to_tensor, by_name, True, traced=True),
        Patch(name, "convert_to_numpy", _convert_to_numpy, star, gated=True),
    ]


def notes() -> list[str]:
    """Whether this nightly's own ``convert_to_numpy`` returns local shards."""
    for core in targets.MODULES["core"]:
        patched = getattr(sys.modules.get(core), "convert_to_numpy", None)
        if not hasattr(patched, "__wrapped__"):
            continue  # not patched here
        function = inspect.unwrap(patched)
        if not targets.convert_to_numpy_gathers(function):
            return [
                "this keras-nightly's get_weights() and predict() return each "
                "process's local shard on their own; the convert family gathers "
                "full values (fixed upstream in 3.16.0.dev2026102704)"
            ]
    return []


IMPLEMENTATION = Implementation(patches, notes=notes)
