"""Keras's loss and metric updates on local tensors when all they see is replicated.

Once row-parallel sums are reduced where they are made, ``y_pred``, ``y``,
the sample weights and the metric variables hold the same full values on
every process, and DTensor's dispatch only adds time to a loss's many small
ops: these run on the local tensors (metric variables written in place). A
loss comes back plain, the same on every process, so its backward starts
without DTensor dispatch. Any other placement keeps the DTensor path. Eager only.
"""

from __future__ import annotations

import functools
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
from keras_dtensor_fix.engine.contract import Implementation, Patch, require
from keras_dtensor_fix.engine.state import compiling
from keras_dtensor_fix.ops.values import flatten_call, local_tensors, unflatten_call


def _local(value: Any, grad: bool) -> Any:
    """A whole DTensor's local tensor (a Partial one reduced first); only with ``grad``
    does one needing a gradient take an autograd op."""
    if not isinstance(value, DTensor):
        return value
    value = reduce_partial(value)
    return unwrap_local(value) if grad and value.requires_grad else value._local_tensor


def _run_local(wrapped, instance, args, kwargs, *, grad: bool = True):
    """A loss (``grad``: its result keeps the gradient path) or a metric update on
    local tensors, ``instance``'s variables local."""
    if compiling() or not getattr(instance, "built", True):
        return wrapped(*args, **kwargs)
    variables = list(instance.variables)
    values = [getattr(variable, "_value", None) for variable in variables]
    dtensors = [value for value in values if isinstance(value, DTensor)]
    if not all(whole(value) for value in dtensors):
        return wrapped(*args, **kwargs)
    mesh = dtensors[0].device_mesh if dtensors else None
    leaves, structure = flatten_call(args, kwargs)
    mesh = planner.replicated(leaves, mesh=mesh, partial=True)
    if mesh is None:
        return wrapped(*args, **kwargs)
    local = [_local(value, grad) for value in leaves]
    with local_tensors(variables):
        args, kwargs = unflatten_call(args, kwargs, structure, local)
        result = wrapped(*args, **kwargs)
    if grad or isinstance(result, DTensor) or not hasattr(result, "shape"):
        return result  # a loss stays plain (see the module's docstring)
    return replicate(result, mesh)


_update_local = functools.partial(_run_local, grad=False)


def patches(module: types.ModuleType) -> list[Patch]:
    wrappers = {"Mean.update_state": _update_local}
    if module.__name__ == targets.COMPILE_UTILS:
        wrappers = {
            "CompileLoss.__call__": _run_local,
            "CompileMetrics.update_state": _update_local,
        }
    for target in wrappers:
        require(module, target)
    # traced: dynamo guards ``type(loss).__call__`` by identity.
    return [
        Patch(module.__name__, target, wrapper, gated=True, traced=True)
        for target, wrapper in wrappers.items()
    ]


IMPLEMENTATION = Implementation(patches)
