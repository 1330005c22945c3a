"""Conversions: ``convert_to_numpy`` gathers, ``convert_to_tensor`` traces.

Nightlies before 2026-10-27 return each process's local shard from
``get_weights()`` and ``predict()``; later ones gather themselves, and the
wrapper only lets a Keras variable holding a DTensor through as its value.

``convert_to_tensor`` (keras-nightly 3.16.0.dev2026102704) reads
``np.array(x).dtype``, which dynamo (torch 2.13) cannot trace:
every numpy value a compiled step converts (keras-hub's attention scales its
queries by ``ops.cast(1 / np.sqrt(head_dim), dtype)``) split the step into
graphs, and DTensor gradients across those breaks fail to compile.
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
from keras_dtensor_fix.ops.values import variable_class, walk
from keras_dtensor_fix.saving import one_writer


def _convert_to_numpy(wrapped, instance, args, kwargs):
    def full(value: Any, _layout: Any) -> Any:
        if isinstance(value, variable_class()):
            value = value.value
        if isinstance(value, DTensor):
            found = one_writer.gathered(value)  # a save's writer: no collective
            return value.detach().full_tensor() if found is None else found
        return value

    if args:
        args = (walk(args[0], None, full),) + args[1:]
    return wrapped(*args, **kwargs)


def _convert_to_tensor_in(core: types.ModuleType) -> Any:
    """The ``convert_to_tensor`` wrapper of Keras's torch ``core`` module.

    Its device and dtype helpers are read here, once: a traced step converts
    hundreds of values, and dynamo would trace each lookup again.
    """
    get_device = getattr(core, "get_device", None)
    to_torch_dtype = getattr(core, "to_torch_dtype", None)

    def convert_to_tensor(wrapped, instance, args, kwargs):
        # Under torch.compile a numpy value goes in as the tensor torch makes
        # of it (same dtype, so the same result as Keras's numpy path); dynamo
        # traces torch.as_tensor of a numpy array. Eager calls take Keras's path.
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
    """Whether Keras's conversion of DTensor ``args[0]`` would return it as is.

    Eager, ``x.to(device)`` and ``x.to(dtype)`` return ``x`` itself when
    nothing changes; traced, each makes a new object, so what the plugin
    keeps on an activation (``dtensor.placed``: the logits the loss gathered,
    which the accuracy metric reads through its own conversion) is lost.
    """
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
    return [
        Patch(
            module.__name__,
            "convert_to_tensor",
            _convert_to_tensor_in(module),
            also_in=targets.aliases("core_by_name"),
            gated=True,
            # a compiled token step on local tensors (gate shut) converts a
            # numpy value (Gemma's query scale) too
            traced=True,
        ),
        Patch(
            module.__name__,
            "convert_to_numpy",
            _convert_to_numpy,
            also_in=targets.aliases("core_star"),
            gated=True,
        ),
    ]


def notes() -> list[str]:
    """Whether this nightly's own ``convert_to_numpy`` returns local shards."""
    for core in targets.modules("core"):
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
