"""Keras-facing argument handling shared by the families and handlers: Keras variables
and numpy arrays to tensors, promotion beside a DTensor, and :class:`DTensorMixError`
for an unfixable mix."""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from keras_dtensor_fix.dtensor import (
    DTensor,
    PromotionError,
    describe,
    find_dtensor,
    has_plain_tensor,
    promote_args,
    replicate_result,
    unwrap_local,
)
from keras_dtensor_fix.engine import targets


def output_laid_out(layer: Any) -> bool:
    """Whether the distribution lays out ``layer``'s output (``<path>/output``): Keras
    then treats it as whole, so local calls leave the layer to Keras."""
    distribution = targets.keras_object("distribution")()
    if distribution is None:
        return False
    path = f"{getattr(layer, 'path', layer.name)}/output"
    return bool(distribution.get_tensor_layout(path))


def walk(data: Any, layout: Any, leaf: Callable[[Any, Any], Any]) -> Any:
    """Apply ``leaf(value, layout)`` through dicts, lists and tuples (``layout``: one
    for all, or a matching structure)."""
    if isinstance(data, dict):
        return {
            k: walk(v, layout[k] if isinstance(layout, dict) else layout, leaf)
            for k, v in data.items()
        }
    if isinstance(data, (list, tuple)):
        layouts = layout if isinstance(layout, (list, tuple)) else [layout] * len(data)
        items = [walk(v, lay, leaf) for v, lay in zip(data, layouts, strict=False)]
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        return type(data)(items)
    return leaf(data, layout)


class DTensorMixError(RuntimeError):
    """An op met DTensors and plain tensors the plugin cannot reconcile; fields (``op``,
    ``operands``, ``layer``, ``cause``, ``hint``) empty when rebuilt from the message
    alone."""

    def __init__(
        self,
        message: str,
        *,
        op: str = "",
        operands: Sequence[str] = (),
        layer: str = "",
        cause: str = "",
        hint: str = "",
    ) -> None:
        super().__init__(message)
        self.op, self.operands, self.layer = op, list(operands), layer
        self.cause, self.hint = cause, hint


def resolve(value: Any) -> Any:
    """A Keras variable as its tensor, a numpy array as a tensor, lists inside."""
    if isinstance(value, torch.Tensor):  # most operands: one check (traced too)
        return value
    variable = targets.keras_object("Variable")
    if isinstance(value, variable):
        return value.value
    if isinstance(value, np.ndarray) and value.ndim:
        return torch.as_tensor(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, variable) for v in value):
        return type(value)(resolve(v) for v in value)
    return value


def flatten_call(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """The leaves of a call's arguments and how to put them back (flat calls skip
    Keras's tree functions)."""
    if not any(isinstance(v, (list, tuple, dict)) for v in (*args, *kwargs.values())):
        return [*args, *kwargs.values()], None
    structure = (args, kwargs)
    return targets.keras_object("tree").flatten(structure), structure


def unflatten_call(
    args: tuple, kwargs: dict, structure: Any, leaves: list[Any]
) -> tuple[tuple, dict]:
    """:func:`flatten_call`'s leaves put back as ``(args, kwargs)``."""
    if structure is None:
        n = len(args)
        return tuple(leaves[:n]), dict(zip(kwargs, leaves[n:], strict=True))
    return targets.keras_object("tree").pack_sequence_as(structure, leaves)


@contextlib.contextmanager
def local_tensors(variables: Sequence[Any], *, grad: bool = False) -> Iterator[None]:
    """Let each DTensor variable's ``.value`` be its local tensor for a while; with
    ``grad`` a trainable one through ``unwrap_local`` (gradient kept)."""
    swapped = []
    try:
        for variable in variables:
            raw = getattr(variable, "_value", None)
            if isinstance(raw, DTensor):
                swapped.append((variable, raw))
                if grad and variable.trainable:
                    variable._value = unwrap_local(raw)
                else:
                    variable._value = raw._local_tensor
        yield
    finally:
        for variable, raw in swapped:
            variable._value = raw


def keras_path() -> str:
    """The path of the innermost Keras layer being called ("" if none)."""
    layer_class = targets.keras_object("Layer")
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, layer_class) and frame.f_code.co_name == "call":
            return getattr(owner, "path", None) or owner.name
        frame = frame.f_back
    return ""


def mix_error(
    op: str, values: list[Any], cause: BaseException, hint: str
) -> DTensorMixError:
    """A :class:`DTensorMixError` naming the op, its operands, the layer and a fix."""
    operands = [describe(v) for v in values if hasattr(v, "shape")]
    why = cause.problem if isinstance(cause, PromotionError) else str(cause)
    layer = keras_path()
    where = f" in Keras layer {layer}" if layer else ""
    message = (
        f"keras-dtensor-fix: {op}{where} could not combine its operands "
        f"[{', '.join(operands)}]: {why}\nWhat to do: {hint}"
    )
    return DTensorMixError(
        message, op=op, operands=operands, layer=layer, cause=why, hint=hint
    )


#: Words of torch's errors about placements (2.13: "Sharding propagation failed").
_DTENSOR_WORDS = ("dtensor", "placement", "sharding", "mixed torch")
#: The ops whose full-value fallback has been logged once.
_WARNED: set[str] = set()

HINT_RULE = (
    "the op fails on the full (gathered) values too ({fallback}), so the "
    "operands do not fit each other: check their shapes and dtypes. If they "
    "are right, give the variables a LayoutMap entry that shards them "
    "compatibly (or leave them replicated)."
)


def promote_call(
    wrapped: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    op: str,
    elementwise: bool,
) -> Any:
    """Call ``wrapped`` after promoting plain tensors next to a DTensor argument."""
    given = [*args, *kwargs.values()]
    values = [resolve(v) for v in given]
    partner = find_dtensor(values)
    if partner is None:
        return wrapped(*args, **kwargs)

    def call(operands: list[Any]) -> Any:
        new_args, new_kwargs = unflatten_call(args, kwargs, None, operands)
        return wrapped(*new_args, **new_kwargs)

    if has_plain_tensor(values):
        try:
            given = promote_args(values, partner, op=op, elementwise=elementwise)
        except PromotionError as err:
            raise mix_error(op, values, err, err.hint) from err
    try:
        return call(given)
    except (RuntimeError, ValueError, NotImplementedError) as err:
        about = any(k in str(err).lower() for k in _DTENSOR_WORDS)
        if isinstance(err, DTensorMixError) or not about:
            raise
        failure = err
    # No DTensor rule for what the op does inside: run it on full values and
    # hand back a Replicate result (correct, but it gathers sharded operands).
    try:
        result = call(full_value(values))
    except Exception as err:
        hint = HINT_RULE.format(fallback=f"{type(err).__name__}: {err}")
        raise mix_error(op, values, failure, hint) from failure
    if op not in _WARNED:
        _WARNED.add(op)
        logging.getLogger("keras_dtensor_fix").warning(
            "%s has no DTensor rule for its inputs: it ran on full (gathered) values "
            "and returned a replicated result. Correct, but it costs a gather each "
            "call; shard the inputs differently to avoid it.",
            op,
        )
    return replicate_result(result, partner.device_mesh)


def full_value(value: Any) -> Any:
    """Each DTensor in ``value`` as its full (gathered) tensor."""
    return walk(
        value, None, lambda v, _: v.full_tensor() if isinstance(v, DTensor) else v
    )


__all__ = [
    "DTensorMixError",
    "flatten_call",
    "full_value",
    "local_tensors",
    "output_laid_out",
    "promote_call",
    "resolve",
    "unflatten_call",
    "walk",
]
