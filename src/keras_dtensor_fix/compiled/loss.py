"""The loss of a step trained block by block, compiled as a region of its own.

In blocks mode the step runs eagerly around its blocks' graphs. The loss of a
causal LM reads logits split over the vocabulary: eagerly, DTensor gathers
them and runs ``log_softmax`` and its backward as separate ops, which a
shallow model pays for as much as for its blocks. The model's ``CompileLoss``
(one output, no loss metrics: Keras's own fast path) therefore calls one
``torch.compile``'d ``call``, as a block does (static shapes, the process's
cache key tag, guards skipped once settled): the loss and its backward are a
graph each, as in the whole step.

The first call (which builds the loss), grad-free calls (evaluation),
calls inside a compiled step and nested targets or sample weights run
Keras's own ``call``; a compile failure sends every later call there too
(warned).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from keras_dtensor_fix.compiled.steady import Steady, code_of
from keras_dtensor_fix.engine import state

#: False: the loss runs eagerly in blocks mode (benchmarks compare).
ENABLED = True
#: Distribution -> the user's cache key tag -> the compiled ``call``.
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
#: Set once a compilation failed: Keras's own ``call`` from then on.
_FAILED: list[bool] = []
#: The attribute marking a loss whose ``call`` this module installed.
_INSTALLED = "_keras_dtensor_fix_loss"
#: Model -> its ``CompileLoss`` routed through the region.
_ROUTED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def install(model: Any, failure: Callable[[BaseException], bool]) -> bool:
    """Route ``model``'s compiled loss through the region; whether it is.

    ``failure(error)`` says whether an error comes from torch.compile itself.
    """
    loss = getattr(model, "_compile_loss", None)
    if loss is None or not ENABLED:
        uninstall(model)
        return False
    for by_tag in _COMPILED.values():
        for compiled in by_tag.values():
            compiled.reset()  # a new step: its guards run again
    if not getattr(loss, _INSTALLED, False):
        call = functools.partial(_region_call, loss, type(loss).call, failure)
        state.set_attribute(loss, "call", call)
        state.set_attribute(loss, _INSTALLED, True)
    _ROUTED[model] = loss
    return True


def uninstall(model: Any) -> None:
    """Give the model's loss its own ``call`` back."""
    try:
        loss = _ROUTED.pop(model, None)
    except TypeError:  # an object no weak reference can hold: nothing routed
        return
    if loss is not None:
        vars(loss).pop("call", None)
        vars(loss).pop(_INSTALLED, None)


def forget() -> None:
    """Drop the compiled region, its failure and the routes."""
    _COMPILED.clear()
    _FAILED.clear()
    _ROUTED.clear()


def _region_call(
    loss: Any,
    original: Callable[..., Any],
    failure: Callable[[BaseException], bool],
    y_true: Any,
    y_pred: Any,
    sample_weight: Any = None,
) -> Any:
    distribution = state.model_parallel()
    nested = torch.utils._pytree.tree_leaves
    if (
        _FAILED
        or not loss.built
        or loss.metrics
        or not torch.is_grad_enabled()
        or state.compiling()
        or distribution is None
        or any(len(nested(v)) > 1 for v in (y_true, y_pred, sample_weight))
        or not isinstance(y_pred, torch.Tensor)
    ):
        return original(loss, y_true, y_pred, sample_weight)
    try:
        return _compiled(original, distribution)(loss, y_true, y_pred, sample_weight)
    except Exception as error:
        if not failure(error):
            raise
        cause = getattr(error, "inner_exception", None) or error
        first = (str(cause).splitlines() or [""])[0][:200]
        _FAILED.append(True)
        warnings.warn(
            f"keras-dtensor-fix: torch.compile failed on the loss "
            f"({type(cause).__name__}: {first}); it runs eagerly from now on.",
            stacklevel=2,
        )
        return original(loss, y_true, y_pred, sample_weight)


def _compiled(original: Callable[..., Any], distribution: Any) -> Callable[..., Any]:
    user_tag = torch.compiler.config.cache_key_tag
    by_tag = _COMPILED.setdefault(distribution, {})
    compiled = by_tag.get(user_tag)
    if compiled is None:
        tag = state.cache_key_tag(distribution, user_tag)
        # Static shapes: DTensor sharding propagation fails on symbolic sizes.
        import os

        backend = os.environ.get("KDF_LOSS_BACKEND", "inductor")
        compiled = torch.compile(original, dynamic=False, backend=backend)
        compiled = torch.compiler.config.patch(cache_key_tag=tag)(compiled)
        compiled = Steady(compiled, code_of(original))
        by_tag[user_tag] = compiled
    return compiled
