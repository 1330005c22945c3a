"""Metric results under ModelParallel: one all-reduce per dtype, in the step.

Each process accumulates its own batches into its replicated metric
variables; the totals are their sum over the batch axis. Upstream
all-reduces every variable each step (early nightlies the DTensor itself,
which has no sharding rule for ``c10d.allreduce_``). Traced: compiled steps too.
"""

from __future__ import annotations

import sys
import types

import torch
from torch.distributed.tensor import DTensor

from keras_dtensor_fix.dtensor import all_reduce_sums
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import model_parallel
from keras_dtensor_fix.ops.values import local_tensors


def _make_metrics_result(owner_name: str):
    """The ``get_metrics_result`` wrapper for the trainer class ``owner_name``."""
    stateless_scope = targets.keras_object("StatelessScope")  # not while tracing

    def _metrics_result(wrapped, instance, args, kwargs):
        dist = model_parallel()
        if dist is None:
            return wrapped(*args, **kwargs)

        mesh = dist.device_mesh.backend_mesh
        names = tuple(mesh.mesh_dim_names or ())
        group = None
        if dist.batch_dim_name in names:
            axis = names.index(dist.batch_dim_name)
            # Eager steps skip a one-process batch axis; compiled ones keep
            # it: without it inductor (torch 2.13) trained the parity MLP wrong.
            if mesh.size(axis) > 1 or torch.compiler.is_compiling():
                group = mesh.get_group(axis)
        variables = instance.metrics_variables
        owner = getattr(sys.modules[targets.TRAINER], owner_name)
        if group is None:  # the local tensors hold the totals
            with torch.no_grad(), local_tensors(variables):
                results = super(owner, instance).get_metrics_result()
        else:
            with torch.no_grad():
                values = [variable.value for variable in variables]
                values = [v.to_local() if isinstance(v, DTensor) else v for v in values]
                # A concatenated copy is reduced: the variables stay.
                values = all_reduce_sums(values, group) if values else values
            with stateless_scope(
                state_mapping=list(zip(variables, values, strict=True))
            ):
                results = super(owner, instance).get_metrics_result()
        return {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in results.items()
        }

    return _metrics_result


def patches(module: types.ModuleType) -> list[Patch]:
    cls = targets.trainer_class(module)
    wrapper, attribute = _make_metrics_result(cls), f"{cls}.get_metrics_result"
    return [Patch(module.__name__, attribute, wrapper, gated=True, traced=True)]


IMPLEMENTATION = Implementation(patches)
