"""Create unsharded variables as Replicate DTensors under ModelParallel.

Upstream keeps a variable with no sharded axis a plain ``Parameter``; the first
op that meets a sharded value (``bias + matmul``) then fails with "got mixed
torch.Tensor and DTensor". As Replicate DTensors they take part in DTensor's
own sharding rules, eager and compiled.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

from keras_dtensor_fix.engine import Patch

FAMILY = "variables"
MODULES = (
    "keras.src.backend.torch.ops.core",
    "keras.src.backend.torch.core",
    "keras.src.backend.torch.distribution_lib",
)


def _make_wrapper(convert_to_tensor: Callable[..., Any]):
    def _initialize_distributed(wrapped, instance, args, kwargs):
        value = wrapped(*args, **kwargs)
        if value is not None:
            return value
        from keras_dtensor_fix.keras_state import model_parallel

        dist = model_parallel()
        if dist is None:
            return None
        return _replicated_parameter(instance, dist, convert_to_tensor, *args, **kwargs)

    return _initialize_distributed


def _replicated_parameter(variable, dist, convert_to_tensor, initializer):
    import torch
    from torch.distributed.tensor import Replicate, distribute_tensor

    if variable._layout is None:
        variable._layout = dist.get_variable_layout(variable)
    if callable(initializer):
        value = initializer(variable._shape, dtype=variable._dtype)
    else:
        value = initializer
    if isinstance(value, torch.nn.Parameter):
        value = value.data
    if isinstance(value, torch.Tensor):
        value = value.detach()
    value = convert_to_tensor(value, dtype=variable._dtype)
    mesh = dist.device_mesh.backend_mesh
    if value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    # distribute_tensor broadcasts rank 0's value, as upstream does for sharded
    # variables, so unseeded ranks still agree.
    dtensor = distribute_tensor(value, mesh, [Replicate()] * mesh.ndim)
    return torch.nn.Parameter(dtensor, requires_grad=variable.trainable)


def placements_of(layout: Any) -> tuple | None:
    """A Keras ``TensorLayout``'s DTensor placements, built from its axis names.

    Under torch.compile, placements read from a cached backend layout come
    through as ``None`` (dynamo did not see them created), so variable
    assignment redistributed to ``(None, None)``. Building them here traces.
    """
    from torch.distributed.tensor import Replicate, Shard

    mesh = getattr(layout, "device_mesh", None)
    axes = getattr(layout, "axes", None)
    if mesh is None or axes is None or not hasattr(mesh, "axis_names"):
        return None
    placements = []
    for name in mesh.axis_names:
        dims = [
            i for i, axis in enumerate(axes)
            if axis == name or (isinstance(axis, (list, tuple)) and name in axis)
        ]
        placements.append(Shard(dims[0]) if dims else Replicate())
    return tuple(placements)


def _distribute_tensor(wrapped, instance, args, kwargs):
    from torch.distributed.tensor import DTensor

    from keras_dtensor_fix.keras_state import compiling

    tensor, layout = (list(args) + [kwargs.get("tensor"), kwargs.get("layout")])[:2]
    if not (isinstance(tensor, DTensor) and compiling()):
        return wrapped(*args, **kwargs)
    placements = placements_of(layout)
    if placements is None:
        return wrapped(*args, **kwargs)
    if tuple(tensor.placements) == placements:
        return tensor
    return tensor.redistribute(tensor.device_mesh, placements)


def patches(module: types.ModuleType) -> list[Patch]:
    if module.__name__.endswith("distribution_lib"):
        return [Patch(FAMILY, module.__name__, "distribute_tensor", _distribute_tensor)]
    if "_initialize_distributed" not in vars(module.Variable):
        raise LookupError(
            "Variable._initialize_distributed not found: this Keras creates "
            "distributed variables another way"
        )
    wrapper = _make_wrapper(module.convert_to_tensor)
    return [Patch(FAMILY, module.__name__, "Variable._initialize_distributed", wrapper)]
