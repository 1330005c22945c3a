"""Repeated blocks compiled once (``KERAS_DTENSOR_FIX_COMPILE=blocks``).

A whole compiled step traces every decoder block again: its start grows with the depth.
In blocks mode the step runs eagerly and each repeated block calls one region shared by
every instance of its class (as torchtitan compiles one transformer block at a time).
Two things would split its graph:

- Keras's name scope: each sublayer's path would be a guard. Inside a region no scope
  opens (:func:`.region.scopeless`); a block whose sublayers' output layouts depend on
  a path is refused (:func:`refusal`).
- Megatron's "f" set on the block's input, a tensor from outside the graph, would be
  an extra output without gradient: the region's first op is the "f" of each DTensor
  input (:func:`_region`), its all-reduce in the block's backward graph.

Where no region may run (:func:`.region.eligible`) the block's own ``call`` runs."""

from __future__ import annotations

import functools
import logging
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree

from keras_dtensor_fix.compiled import refusals, region
from keras_dtensor_fix.dtensor import (
    DTensor,
    reducing_input,
    zero_gradients_if_unused,
)
from keras_dtensor_fix.engine import state, targets
from keras_dtensor_fix.hub import generation as hub


def repeated(model: Any, least: int = 2) -> list[Any]:
    """The model's repeated blocks, outermost first: those a keras-hub backbone lists
    where it lists ``least`` or more, else layers with sublayers whose class occurs
    twice or more, not nested in another such layer, never a model."""
    listed = hub.decoder_blocks(model)
    if listed:
        return listed if len(listed) >= least else []
    model_class = targets.keras_object("Model")
    composite = [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if not isinstance(layer, model_class)
        and any(True for _ in layer._flatten_layers(include_self=False))
    ]
    counts = Counter(type(layer) for layer in composite)
    candidates = [layer for layer in composite if counts[type(layer)] >= 2]
    inner = {
        id(sub)
        for layer in candidates
        for sub in layer._flatten_layers(include_self=False, recursive=True)
    }
    return [layer for layer in candidates if id(layer) not in inner]


def refusal(block: Any) -> str | None:
    """Why ``block`` cannot run as its class's shared graph, or None."""
    if getattr(block, "_remat_mode", None) is not None:
        return "it is rematerialized"
    if getattr(block, "quantization_mode", None) is not None:
        return "it is quantized"
    return refusals.layers(block._flatten_layers(include_self=False, recursive=True))


def choose(model: Any, mode: str) -> tuple[str, str]:
    """Which compilation ``model``'s steps get, ``step`` or ``blocks``, and why:
    ``auto`` goes block by block where the model repeats blocks and none is refused."""
    if mode != "auto":
        return mode, f"KERAS_DTENSOR_FIX_COMPILE={mode}"
    found = repeated(model)
    if not found:
        return "step", "the default: the model repeats no block"
    for block in found:
        reason = refusal(block)
        if reason is not None:
            return "step", f"the default: block {block.name} cannot ({reason})"
    counts = Counter(type(block).__name__ for block in found)
    named = ", ".join(f"{count} {name}" for name, count in counts.items())
    return "blocks", (
        f"the default for repeated blocks ({named}); "
        "KERAS_DTENSOR_FIX_COMPILE=step compiles the whole step"
    )


#: How the last step built compiles, and why (``status()``'s notes).
LAST: list[str] = []


def tell(model: Any, building: str | None, mode: str, why: str) -> None:
    """Log once which compilation a step got (``mode``) and why."""
    if mode == "step" and why.endswith("=blocks"):
        why += ", but the model repeats no block it can compile alone"
    how = "block by block" if mode == "blocks" else "as a whole"
    what = (building or "make_train_function")[len("make_") : -len("_function")]
    line = f"{model.name}'s {what} step compiles {how}: {why}"
    if line not in LAST:
        logging.getLogger("keras_dtensor_fix").info("keras-dtensor-fix: %s", line)
    LAST[:] = [line]


def install(model: Any) -> list[Any]:
    """Route each repeated block of ``model`` through its class's region; the blocks
    routed (those refused named in one warning)."""
    routed, refused = [], []
    region.reset_all()  # a new step: every block's guards run again
    for block in repeated(model):
        if getattr(vars(block).get("call"), "func", None) is _region_call:
            routed.append(block)  # installed already
            continue
        reason = refusal(block)
        if reason is not None:
            refused.append(f"{block.name} ({reason})")
            continue
        call = functools.partial(_region_call, block, type(block).call)
        state.set_attribute(block, "call", call)
        routed.append(block)
    if refused:
        warnings.warn(
            "keras-dtensor-fix: KERAS_DTENSOR_FIX_COMPILE=blocks runs these "
            f"blocks eagerly: {'; '.join(refused[:4])}. A block is compiled once "
            "for every block of its class only where nothing depends on its "
            "sublayers' paths.",
            stacklevel=3,
        )
    return routed


def uninstall(routed: list[Any]) -> None:
    """Give the ``routed`` blocks their own ``call`` back."""
    for block in routed:
        vars(block).pop("call", None)


def _region_call(block, original, *args, **kwargs):
    if region.SCOPELESS or not region.eligible():
        return original(block, *args, **kwargs)
    compiled = _region(type(block), original)
    with region.scopeless():
        result = compiled(lambda: None, block, *args, **kwargs)
    if compiled.failed:  # its blocks' own call from now on (warned)
        return original(block, *args, **kwargs)
    return _tangents_ready(result)


def _tangents_ready(result: Any) -> Any:
    """A region's outputs, each given a DTensor gradient where it gets none: a block
    returning more than its hidden states (Gemma4's KV cache) left the rest with plain
    zeros, which its backward graph refused (torch 2.13)."""
    leaves, spec = pytree.tree_flatten(result)
    if sum(isinstance(v, DTensor) and v.requires_grad for v in leaves) < 2:
        return result
    return pytree.tree_unflatten(zero_gradients_if_unused(leaves), spec)


def _region(cls: type, original: Callable[..., Any]) -> region.Region:
    """The class's region under this distribution, shared by its blocks."""

    def with_f(block: Any, *args: Any, **kwargs: Any) -> Any:
        # Megatron's "f" of each DTensor input in the graph
        args, kwargs = pytree.tree_map(reducing_input, (args, kwargs))
        return original(block, *args, **kwargs)

    return region.of_class(
        (cls, torch.compiler.config.cache_key_tag),
        lambda: region.Region(
            with_f,
            cls.__name__,
            qualname=original.__qualname__,
            then="its blocks run eagerly from now on.",
            interleaved=True,
        ),
    )
