"""The torch backend's nn, math, linalg, image and core ops on DTensors.

Every multi-tensor function gets the op-handler table's wrapper
(:mod:`keras_dtensor_fix.ops.handlers`); from the core module ``slice_update``,
``slice`` and ``fori_loop``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch

from keras_dtensor_fix.dtensor import DTensor, find_dtensor, replicate, replicate_plain
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.ops import handlers
from keras_dtensor_fix.ops.values import resolve

#: The core module's own functions that write one tensor into another.
CORE = ("slice_update",)


def _static(value: Any) -> bool:
    return isinstance(value, (int, torch.SymInt))


def _slice(convert_to_tensor: Any, wrapped: Any, instance: Any, args, kwargs) -> Any:
    """``slice(inputs, start_indices, shape)`` with a tensor start (keras-hub's
    ``PositionEmbedding`` at a cache index), traced, gathers the rows: Keras's
    ``torch.narrow`` on the start's value breaks the graph, and AOT autograd rebuilds
    the view with ``as_strided``, refused on DTensors (pytorch/pytorch#184002)."""
    if not torch.compiler.is_compiling():
        return wrapped(*args, **kwargs)
    names = ("inputs", "start_indices", "shape")
    bound = dict(zip(names, args, strict=False), **kwargs)
    starts, shape = bound.get("start_indices"), bound.get("shape")
    if (
        set(bound) != set(names)
        or not isinstance(starts, (list, tuple))
        or not isinstance(shape, (list, tuple))
        or len(starts) != len(shape)
        or not all(_static(n) for n in shape)
        or not all(_static(s) or _scalar(s) for s in starts)
        or all(_static(s) for s in starts)
    ):
        return wrapped(*args, **kwargs)
    result = convert_to_tensor(bound["inputs"])
    for dim, (start, length) in enumerate(zip(starts, shape, strict=True)):
        if _static(start):
            result = torch.narrow(result, dim, start, length)
        else:
            if isinstance(start, DTensor):  # a 0-d value: whole on every rank
                start = start.full_tensor()
            # narrow counts a negative start from the end
            start = start.to(device=result.device, dtype=torch.int64)
            start = torch.where(start < 0, start + result.shape[dim], start)
            rows = start + torch.arange(length, device=result.device)
            if isinstance(result, DTensor):
                rows = replicate(rows, result.device_mesh)
            result = torch.index_select(result, dim, rows)
    return result


def _scalar(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.ndim == 0


def _closed_over(fn: Any) -> list[Any]:
    """The values ``fn`` closes over (Keras variables as their tensors)."""
    values = []
    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):  # a cell not yet filled
            values.append(resolve(cell.cell_contents))
    return values


def _fori_loop(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``fori_loop(lower, upper, body_fun, init_val)`` whose body closes over a DTensor
    (RWKV-7's time mix) writes DTensors into plain carries in place, which DTensor
    refuses: such carries enter as Replicate DTensors."""
    names = ("lower", "upper", "body_fun", "init_val")
    bound = dict(zip(names, args, strict=False), **kwargs)
    if set(bound) != set(names):
        return wrapped(*args, **kwargs)
    partner = find_dtensor(_closed_over(bound["body_fun"]))
    if partner is None:
        return wrapped(*args, **kwargs)
    bound["init_val"] = replicate_plain(bound["init_val"], partner.device_mesh)
    return wrapped(**bound)


def patches(module: types.ModuleType) -> list[Patch]:
    name = module.__name__
    core = targets.is_kind(name, "core")
    also_in = targets.ALIASES["core"] if core else ()
    found = []
    if core and hasattr(module, "slice") and hasattr(module, "convert_to_tensor"):
        wrapper = functools.partial(_slice, module.convert_to_tensor)
        # traced: a generation's local token call (gate shut) needs it too
        found.append(Patch(name, "slice", wrapper, also_in, True, traced=True))
    if core and hasattr(module, "fori_loop"):
        found.append(Patch(name, "fori_loop", _fori_loop, also_in, True))
    for op in CORE if core else handlers.target_names(module):
        if hasattr(module, op):
            wrapper = handlers.wrapper_for(op, getattr(module, op), elementwise=False)
            found.append(Patch(name, op, wrapper, also_in, gated=True))
    return found


IMPLEMENTATION = Implementation(patches)
