"""Keras's loss and metric updates on local tensors when all they see is replicated.

Once a row-parallel layer's Partial sum is reduced where it is made, ``y_pred``,
``y`` and the sample weights hold the same full values on every process, and so
do the metric variables (Replicate DTensors). DTensor's per-op dispatch then
only adds time to the many small ops of a loss or a metric update: these run on
the local tensors instead, with the metric variables showing their local
tensors for the call (written in place, so the DTensors see every update). A
loss comes back as the plain tensor it was computed as: the full value, the
same on every process, so its backward starts without DTensor dispatch (an op
that later meets a DTensor promotes it). Any other placement (``y_pred``
sharded over a batch axis, a sharded metric variable) keeps the DTensor path.
Eager only: compiled steps trace the original.
"""

from __future__ import annotations

import types
from typing import Any

from keras_dtensor_fix.dtensor import (
    DTensor,
    planner,
    reduce_partial,
    replicate,
    unwrap_local,
    whole,
)
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import compiling
from keras_dtensor_fix.ops.values import flatten_call, local_tensors, unflatten_call


def local_inputs(
    values: list[Any], *, grad: bool = True, mesh: Any = None
) -> tuple[Any, list[Any]] | None:
    """``values`` with whole DTensors as local tensors, and their mesh.

    :func:`planner.replicated` decides, a Partial value allowed: it is reduced
    first, as its first op would reduce it. ``mesh`` is the mesh of the
    caller's variables (labels may hold no DTensor). Only a DTensor that needs
    a gradient takes an autograd op (``unwrap_local``), and only when the
    caller wants gradients (``grad``).
    """
    mesh = planner.replicated(values, mesh=mesh, partial=True)
    if mesh is None:
        return None
    local = []
    for value in values:
        if isinstance(value, DTensor):
            value = reduce_partial(value)
            if grad and value.requires_grad:
                value = unwrap_local(value)
            else:
                value = value._local_tensor
        local.append(value)
    return mesh, local


def _run_local(wrapped, instance, args, kwargs):
    """A loss on local tensors (its result keeps the gradient path)."""
    return _call_local(wrapped, instance, args, kwargs, grad=True)


def _update_local(wrapped, instance, args, kwargs):
    """A metric update on local tensors (metrics take no gradients)."""
    return _call_local(wrapped, instance, args, kwargs, grad=False)


def _call_local(wrapped, instance, args, kwargs, *, grad: bool):
    """Call ``wrapped`` on local tensors, with ``instance``'s variables local."""

    if compiling() or not getattr(instance, "built", True):
        return wrapped(*args, **kwargs)
    variables = list(instance.variables)
    mesh = None
    for variable in variables:
        value = getattr(variable, "_value", None)
        if isinstance(value, DTensor):
            if not whole(value):
                return wrapped(*args, **kwargs)
            if mesh is None:
                mesh = value.device_mesh
    leaves, structure = flatten_call(args, kwargs)
    found = local_inputs(leaves, grad=grad, mesh=mesh)
    if found is None:
        return wrapped(*args, **kwargs)
    mesh, local = found
    with local_tensors(variables):
        args, kwargs = unflatten_call(args, kwargs, structure, local)
        result = wrapped(*args, **kwargs)
    if grad or isinstance(result, DTensor) or not hasattr(result, "shape"):
        return result  # a loss stays plain (see the module's docstring)
    return replicate(result, mesh)


def patches(module: types.ModuleType) -> list[Patch]:
    if module.__name__ == targets.COMPILE_UTILS:
        names = ("CompileLoss.__call__", "CompileMetrics.update_state")
    else:
        names = ("Mean.update_state",)
    for target in names:
        owner, name = target.split(".")
        if name not in vars(getattr(module, owner, object)):
            raise LookupError(f"{target} not found: this Keras moved it")
    # traced: a compiled step then meets a plain function on the class (dynamo
    # 2.13 guards ``type(loss).__call__`` by identity), calling the original.
    return [
        Patch(
            module.__name__,
            target,
            _run_local if target.endswith("__call__") else _update_local,
            gated=True,
            traced=True,
        )
        for target in names
    ]


IMPLEMENTATION = Implementation(patches)
