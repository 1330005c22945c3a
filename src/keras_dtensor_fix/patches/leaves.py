"""Leaf layers on local tensors: norms, rotary embeddings, softmax.

Between a sharded model's row-parallel sums and its column-parallel products,
activations are replicated, and a layer with no sublayers and replicated
weights (a layer norm, an RMS norm, a position embedding) computes the same
full value on every rank. Through DTensor, each of its small ops is a
dispatched op forward and more backward, each costing more than the op. Such
a layer runs here as one process runs it: its inputs and weights as local
tensors (one unwrap each), its output wrapped once as a Replicate DTensor.
Layers that read across only some axes (``targets.MIXING_LAYERS``, Keras's
and keras-hub's: softmax over its axis, a rotary embedding over sequence and
features) also run on shards split on the other axes (the attention heads),
their output keeping the input's placements. ``dtensor.planner.region``
decides; gradients are the local backward of each rank's piece, exact.

Anything else calls the original: a layer with sublayers, sharded weights, a
seed generator (dropout draws its own way), a Keras mask, an activity
regularizer, an output layout in the distribution's LayoutMap, a layer not yet
built, a stateless scope, a nested call, a first argument that is not a
DTensor and compiled steps. Each layer's first local call is checked
against its own call on DTensors (``ops.first_call``): one that raises, or
differs, warns once and runs on DTensors from then on. Gated.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch

from keras_dtensor_fix.dtensor import DTensor, local_region, whole
from keras_dtensor_fix.dtensor import wrap_local as _wrap
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import compiling
from keras_dtensor_fix.ops.first_call import PROVEN, REFUSED, FirstCall
from keras_dtensor_fix.ops.values import (
    flatten_call,
    local_tensors,
    output_laid_out,
    unflatten_call,
)

#: True while a leaf runs locally: a layer it calls runs as it is.
_ACTIVE: list[bool] = []
#: Layer class -> its kind in :data:`targets.MIXING_LAYERS`, or None.
_KINDS: dict[type, str | None] = {}
#: Each layer's first local call, checked against DTensor's path.
FIRST = FirstCall("the leaves family's local call")
#: Layers whose output the LayoutMap lays out (checked once per layer).
_LAID_OUT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _kind(layer: Any) -> str | None:
    cls = type(layer)
    try:
        return _KINDS[cls]
    except KeyError:
        key = (cls.__module__, cls.__qualname__)
        kind = targets.MIXING_LAYERS.get(key)
        _KINDS[cls] = kind
        return kind


def mixes(layer: Any, ndim: int) -> frozenset[int] | None:
    """The input dims ``layer`` reads across (None: unknown, all of them)."""
    kind = _kind(layer)
    if kind == "softmax":
        axes = layer.axis if isinstance(layer.axis, (list, tuple)) else (layer.axis,)
        return frozenset(a % ndim for a in axes)
    if kind == "rotary":
        return frozenset((layer.sequence_axis % ndim, layer.feature_axis % ndim))
    return None


def _laid_out(layer: Any) -> bool:
    """:func:`~keras_dtensor_fix.ops.values.output_laid_out`, once per layer."""
    try:
        return _LAID_OUT[layer]
    except KeyError:
        pass
    found = _LAID_OUT[layer] = output_laid_out(layer)
    return found


def _plain(instance: Any) -> bool:
    """Whether ``instance`` must run as it is (see the module's docstring).

    :func:`_call` has tested the cheap ones: every layer call of a process
    that once sharded comes there, distributed or not.
    """
    return bool(
        getattr(instance, "_layers", True)
        or getattr(instance, "_seed_generators", True)
        or not getattr(instance, "built", False)
        or getattr(instance, "activity_regularizer", None) is not None
        or compiling()
        or targets.keras_object("global_state").get_global_attribute("stateless_scope")
        is not None
    )


def _call(wrapped, instance, args, kwargs):
    """``Layer.__call__`` on local tensors where every rank's piece computes alone."""
    if _ACTIVE or not args or not isinstance(args[0], DTensor) or _plain(instance):
        return wrapped(*args, **kwargs)
    known = FIRST.known(instance)
    if known is REFUSED:
        return wrapped(*args, **kwargs)
    variables = instance._trainable_variables + instance._non_trainable_variables
    for variable in variables:
        value = getattr(variable, "_value", None)
        if isinstance(value, DTensor) and not whole(value):
            return wrapped(*args, **kwargs)
    leaves, structure = flatten_call(args, kwargs)
    for leaf in leaves:
        if getattr(leaf, "_keras_mask", None) is not None:
            return wrapped(*args, **kwargs)
    first = args[0]
    try:
        # A layer with weights runs locally only where everything is
        # replicated: its weights would meet the shards whole.
        axes = None if variables else mixes(instance, first.ndim)
        found = local_region(leaves, axes)
    except Exception as error:  # the recognition itself: DTensor's path
        FIRST.failed(instance, error)
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

    if known is PROVEN:
        return local()
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
    if "__call__" not in vars(getattr(module, "Layer", object)):
        raise LookupError("Layer.__call__ not found: this Keras moved it")
    # eager_only: a plain function on the class (torch 2.13's dynamo fails a guard on
    # wrapt's bound proxy as ``type(layer).__call__``) that sends dynamo to
    # the original, so compiled steps trace no extra frame per layer call.
    return [
        Patch(module.__name__, "Layer.__call__", _call, gated=True, eager_only=True)
    ]


IMPLEMENTATION = Implementation(patches, after_revert=FIRST.forget)
