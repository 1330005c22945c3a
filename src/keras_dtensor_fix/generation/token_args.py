"""A causal LM's ``call_with_cache`` arguments: the three every call takes, the rest.

keras-hub's causal LMs share the first three parameters (token ids, cache,
index: ``hub.generation.CALL_WITH_CACHE``) but not what follows, which some
pass by keyword. Generation converts the first three and hands every other
argument on as the caller gave it; :func:`one_token` tells them apart by the
model's own signature, or says it cannot.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keras_dtensor_fix.hub import generation as hub

__all__ = ["TokenArgs", "one_token", "signature_of"]

CORE = len(hub.CALL_WITH_CACHE)


@dataclass
class TokenArgs:
    """One call's ``token_ids``, ``cache``, ``index``, and the others by
    keyword (as given: no default filled in)."""

    token_ids: Any
    cache: Any
    index: Any
    extra: dict[str, Any]

    def core(self) -> tuple[Any, Any, Any]:
        return self.token_ids, self.cache, self.index

    def call(self, function: Callable[..., Any], *first: Any) -> Any:
        """``function(*first, token_ids, cache, index, **extra)``."""
        return function(*first, *self.core(), **self.extra)


def signature_of(method: Callable[..., Any]) -> inspect.Signature | None:
    """``method``'s signature where :func:`one_token` can read its calls (the
    three core parameters first, positional, no ``*args``), else None."""
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return None
    params = list(signature.parameters.values())
    core, rest = params[:CORE], params[CORE:]
    # parameter kinds are ordered: the positional ones come first
    if len(core) < CORE or any(p.kind > p.POSITIONAL_OR_KEYWORD for p in core):
        return None
    # :class:`TokenArgs` hands the rest on by keyword
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.POSITIONAL_ONLY)
    return None if any(p.kind in kinds for p in rest) else signature


def one_token(
    signature: inspect.Signature, args: tuple, kwargs: dict
) -> TokenArgs | None:
    """The call's arguments bound by ``signature`` (:func:`signature_of`'s)
    where it passes one token per sequence; None for the prompt's pass or
    arguments that do not bind (the model's own call then raises)."""
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return None
    names = list(signature.parameters)[:CORE]
    if any(name not in bound for name in names):
        return None
    token_ids, cache, index = (bound.pop(name) for name in names)
    shape = getattr(token_ids, "shape", ())
    if len(shape) != 2 or shape[1] != 1:
        return None
    extra: dict[str, Any] = {}
    for name, value in bound.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            extra.update(value)
        else:
            extra[name] = value
    return TokenArgs(token_ids, cache, index, extra)
