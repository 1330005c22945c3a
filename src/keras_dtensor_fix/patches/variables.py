"""Create unsharded variables as Replicate DTensors under ModelParallel.

Upstream keeps a variable with no sharded axis a plain ``Parameter``; the
first op meeting a sharded value (``bias + matmul``) then fails with "got
mixed torch.Tensor and DTensor". The other patches here serve those DTensors.
"""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from keras_dtensor_fix.dtensor import (
    forget_meshes,
    is_replicated,
    replicate,
    same_mesh,
)
from keras_dtensor_fix.engine import state, targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require
from keras_dtensor_fix.engine.state import compiling, model_parallel, note_sharding


class LayoutError(ValueError):
    """A variable's layout cannot shard it; ``variable``, ``axes``, ``hint``."""

    def __init__(self, variable: str, shape: tuple, axes: tuple, hint: str) -> None:
        self.variable, self.shape, self.axes, self.hint = variable, shape, axes, hint
        super().__init__(
            f"keras-dtensor-fix: the layout {axes} given to variable '{variable}' "
            f"(shape {shape}) has {len(axes)} axes for its {len(shape)} dims. "
            f"What to do: {hint}"
        )


def check_layout(variable: Any, layout: Any) -> None:
    """Refuse a layout whose axes do not match the variable's dims (torch fails later,
    inside DTensor)."""
    axes = tuple(getattr(layout, "axes", None) or ())
    shape = tuple(getattr(variable, "shape", ()) or ())
    if not axes or len(axes) == len(shape):
        return
    named = [axis for axis in axes if axis is not None]
    works: tuple = (None,) * len(shape)
    if named and shape:
        works = (None,) * (len(shape) - 1) + (named[0],)
    raise LayoutError(
        getattr(variable, "path", getattr(variable, "name", "?")),
        shape,
        axes,
        f"give it {len(shape)} axes in the LayoutMap, e.g. {works} "
        f"(or {(None,) * len(shape)} to replicate it).",
    )


def _initialize_distributed(convert_to_tensor, wrapped, instance, args, kwargs):
    dist = model_parallel()
    if dist is not None and instance._layout is None:
        # What Keras's own method does first: it is not done again.
        instance._layout = dist.get_variable_layout(instance)
    if dist is not None:
        check_layout(instance, instance._layout)
    value = wrapped(*args, **kwargs)
    if value is not None or dist is None:
        return value
    return _replicated_parameter(instance, dist, convert_to_tensor, *args, **kwargs)


def _replicated_parameter(variable, dist, convert_to_tensor, initializer):
    value = initializer
    if callable(initializer):
        value = initializer(variable._shape, dtype=variable._dtype)
    if isinstance(value, torch.Tensor):  # a Parameter too: detached, a plain tensor
        value = value.detach()
    value = convert_to_tensor(value, dtype=variable._dtype)
    mesh = dist.device_mesh.backend_mesh
    if value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    note_sharding()
    # distribute_tensor broadcasts rank 0's value: unseeded ranks agree.
    dtensor = distribute_tensor(value, mesh, [Replicate()] * mesh.ndim)
    return torch.nn.Parameter(dtensor, requires_grad=variable.trainable)


SPEC = "_keras_dtensor_fix_spec"


def _spec(placements: Any) -> tuple:
    """Placements as plain data (dynamo reads it as constants)."""
    return tuple(("S", p.dim) if p.is_shard() else ("R",) for p in placements)


def placements_of(layout: Any, tensor: Any) -> tuple:
    """The placements ``layout`` gives, rebuilt so that dynamo can trace them
    (read from a cached backend layout, they come through as ``None``)."""
    spec = getattr(layout, SPEC, None)
    # A Keras layout has axes; a backend one's torch mesh is opaque to dynamo.
    if spec is None and hasattr(layout, "axes"):
        names = getattr(getattr(layout, "device_mesh", None), "axis_names", None)
        spec = None if names is None else tuple(_split(layout.axes, n) for n in names)
    if spec is None:  # a layout made before activation: keep the value's own
        spec = _spec(tensor.placements)
    return tuple(Shard(item[1]) if item[0] == "S" else Replicate() for item in spec)


def _split(axes: Any, name: str) -> tuple:
    """``("S", dim)`` for the dim mesh axis ``name`` splits, else ``("R",)``."""
    for i, axis in enumerate(axes):
        if axis == name or (isinstance(axis, (list, tuple)) and name in axis):
            return ("S", i)
    return ("R",)


def _to_backend_layout(wrapped, instance, args, kwargs):
    layout = wrapped(*args, **kwargs)
    placements = getattr(layout, "placements", None)
    if placements is not None and not hasattr(layout, SPEC):
        with contextlib.suppress(AttributeError, TypeError):
            state.set_attribute(layout, SPEC, _spec(placements))
    return layout


def _to_backend_mesh(wrapped, instance, args, kwargs):
    """One torch DeviceMesh per Keras DeviceMesh (early nightlies build one
    per ``get_metrics_result``, which dynamo cannot trace)."""
    device_mesh = args[0] if args else kwargs.get("device_mesh")
    cached = getattr(device_mesh, "_backend_mesh", None)
    if cached is not None:
        return cached
    mesh = wrapped(*args, **kwargs)
    forget_meshes()
    with contextlib.suppress(AttributeError):
        state.set_attribute(device_mesh, "_backend_mesh", mesh)
    return mesh


def _distribute_tensor(wrapped, instance, args, kwargs):
    tensor = args[0] if args else kwargs.get("tensor")
    layout = args[1] if len(args) > 1 else kwargs.get("layout")
    if (
        layout is not None
        and getattr(tensor, "ndim", None) == 0
        and not isinstance(tensor, DTensor)
    ):
        backend = getattr(layout, "backend_layout", layout)
        if all(p.is_replicate() for p in getattr(backend, "placements", None) or ()):
            # A scalar for a replicated variable: the same everywhere, no broadcast.
            return replicate(tensor, backend.device_mesh)
    if layout is None or not (isinstance(tensor, DTensor) and compiling()):
        return wrapped(*args, **kwargs)
    placements = placements_of(layout, tensor)
    if tuple(tensor.placements) == placements:
        return tensor
    return tensor.redistribute(tensor.device_mesh, placements)


def _direct_assign(wrapped, instance, args, kwargs):
    """Write a replicated variable's local tensor when nothing moves (a
    scalar, or the same mesh and placements), without DTensor's dispatch."""
    current = getattr(instance, "_value", None)
    value = args[0] if args else kwargs.get("value")
    if (
        isinstance(current, DTensor)
        and isinstance(value, torch.Tensor)
        and not compiling()
        and is_replicated(current)
    ):
        local = value if value.ndim == 0 else None
        if isinstance(value, DTensor):
            moves = not same_mesh(value.device_mesh, current.device_mesh)
            moves = moves or tuple(value.placements) != tuple(current.placements)
            local = None if moves else value._local_tensor
        if local is not None:
            with torch.no_grad():
                current._local_tensor.copy_(local)
            return None
    return wrapped(*args, **kwargs)


def patches(module: types.ModuleType) -> list[Patch]:
    name = module.__name__
    if targets.is_kind(name, "distribution_lib"):
        trainer = targets.ALIASES["trainer"]
        return [
            Patch(name, "distribute_tensor", _distribute_tensor),
            Patch(name, "_to_backend_layout", _to_backend_layout),
            Patch(name, "_to_backend_mesh", _to_backend_mesh, also_in=trainer),
        ]
    why = "this Keras creates distributed variables another way"
    initialize = require(module, "Variable._initialize_distributed", why)
    wrapper = functools.partial(_initialize_distributed, module.convert_to_tensor)
    result = [Patch(name, initialize, wrapper)]
    if "_direct_assign" in vars(module.Variable):
        # traced: compiled steps assign too; dynamo must run the original.
        assign = "Variable._direct_assign"
        result.append(Patch(name, assign, _direct_assign, gated=True, traced=True))
    return result


IMPLEMENTATION = Implementation(patches)
