"""Leaf layers on local tensors: norms, rotary embeddings, softmax.

Between row-parallel sums and column-parallel products activations are
replicated, and a leaf layer with replicated weights computes the same full
value on every rank, each small op paying DTensor's dispatch: it runs as one
process runs it, inputs and weights local, the output wrapped once. Layers
reading across some axes only (``targets.MIXING_LAYERS``) also run on shards
split on the others (attention heads); ``dtensor.planner.region`` decides.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch

from keras_dtensor_fix.dtensor import DTensor, local_region, whole
from keras_dtensor_fix.dtensor import wrap_local as _wrap
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require
from keras_dtensor_fix.engine.state import compiling
from keras_dtensor_fix.ops.first_call import REFUSED, FirstCall, first_line
from keras_dtensor_fix.ops.values import (
    flatten_call,
    local_tensors,
    output_laid_out,
    unflatten_call,
)

#: True while a leaf runs locally: a layer it calls runs as it is.
_ACTIVE: list[bool] = []
#: Each layer's first local call, checked against DTensor's path.
FIRST = FirstCall("the leaves family's local call")
#: Layers whose output the LayoutMap lays out (checked once per layer).
_LAID_OUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def mixes(layer: Any, ndim: int) -> frozenset[int] | None:
    """The input dims ``layer`` reads across (None: unknown, all of them)."""
    cls = type(layer)
    kind = targets.MIXING_LAYERS.get((cls.__module__, cls.__qualname__))
    if kind == "softmax":
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else (layer.axis,)
        return frozenset(a % ndim for a in axes)
    if kind == "rotary":
        return frozenset((layer.sequence_axis % ndim, layer.feature_axis % ndim))
    return None


def _laid_out(layer: Any) -> bool:
    """:func:`~keras_dtensor_fix.ops.values.output_laid_out`, once per layer."""
    if layer not in _LAID_OUT:
        _LAID_OUT[layer] = output_laid_out(layer)
    return _LAID_OUT[layer]


def _call(wrapped, instance, args, kwargs):
    """``Layer.__call__`` on local tensors where every rank's piece computes alone."""
    if (
        _ACTIVE
        or not args
        or not isinstance(args[0], DTensor)
        or getattr(instance, "_layers", True)
        or getattr(instance, "_seed_generators", True)
        or not getattr(instance, "built", False)
        or getattr(instance, "activity_regularizer", None) is not None
        or compiling()
        or targets.keras_object("global_state").get_global_attribute("stateless_scope")
        is not None
        or FIRST.known(instance) is REFUSED
    ):
        return wrapped(*args, **kwargs)
    variables = instance._trainable_variables + instance._non_trainable_variables
    values = [getattr(variable, "_value", None) for variable in variables]
    leaves, structure = flatten_call(args, kwargs)
    if any(isinstance(v, DTensor) and not whole(v) for v in values) or any(
        getattr(leaf, "_keras_mask", None) is not None for leaf in leaves
    ):
        return wrapped(*args, **kwargs)
    try:
        # A layer with weights: only where everything is replicated.
        axes = None if variables else mixes(instance, args[0].ndim)
        found = local_region(leaves, axes)
    except Exception as error:  # the recognition itself: DTensor's path
        FIRST.refuse(instance, f"raised ({first_line(error)})")
        return wrapped(*args, **kwargs)
    if found is None or _laid_out(instance):
        return wrapped(*args, **kwargs)

    def local() -> Any:
        mesh, placements, local = found
        local_args, local_kwargs = unflatten_call(args, kwargs, structure, local)
        _ACTIVE.append(True)
        try:
            with local_tensors(variables, grad=True):
                result = wrapped(*local_args, **local_kwargs)
        finally:
            _ACTIVE.pop()
        return _wrap_all(result, mesh, placements)

    written = instance._non_trainable_variables
    return FIRST.run(instance, local, lambda: wrapped(*args, **kwargs), written)


def _wrap_all(result: Any, mesh: Any, placements: tuple) -> Any:
    def one(value: Any) -> Any:
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return value
        mask = getattr(value, "_keras_mask", None)
        wrapped = _wrap(value, mesh, placements)
        if mask is not None:
            wrapped._keras_mask = one(mask)
        return wrapped

    if isinstance(result, torch.Tensor):
        return one(result)
    return targets.keras_object("tree").map_structure(one, result)


def patches(module: types.ModuleType) -> list[Patch]:
    call = require(module, "Layer.__call__")
    # Not traced: dynamo is sent to the original (no extra frame per call).
    return [Patch(module.__name__, call, _call, gated=True)]


IMPLEMENTATION = Implementation(patches, after_revert=FIRST.forget)
