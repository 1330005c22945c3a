"""Warm compile caches for steps that trace a numpy operator.

keras-hub's Gemma scales its queries by ``1 / np.sqrt(head_dim)`` inside the
step; dynamo traces the numpy call (``numpy_to_tensor_wrapper``, which AOT
autograd's cache accepts by its numpy name) and the division by it
(``numpy_operator_wrapper(operator.truediv)``, which it does not: "Unsupported
call_function target <Wrapped operator <original wrapped_truediv>>"). So every
launch bypassed the cache and compiled again, on one process too. An operator
wrapper does nothing but apply a function of the ``operator`` module, so it
is keyed by that function's name here, as torch keys the numpy wrappers.
"""

from __future__ import annotations

import operator
import sys
import types

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch


def operator_key(obj: object) -> tuple[str, str] | None:
    """A cache key for a ``numpy_operator_wrapper`` of an ``operator`` function."""
    cls = type(obj)
    utils = sys.modules.get("torch._dynamo.utils")
    if cls is not getattr(utils, "numpy_operator_wrapper", None):
        return None
    op = getattr(obj, "op", None)
    name = getattr(op, "__name__", "")
    if not name or getattr(operator, name, None) is not op:
        return None
    return (cls.__qualname__, f"operator.{name}")


def _cache_key(wrapped, instance, args, kwargs):
    key = wrapped(*args, **kwargs)
    if key is None and args:
        key = operator_key(args[0])
    return key


def patches(module: types.ModuleType) -> list[Patch]:
    if not callable(getattr(module, "numpy_wrapper_cache_key", None)):
        raise LookupError("numpy_wrapper_cache_key")
    return [
        Patch(
            module.__name__,
            "numpy_wrapper_cache_key",
            _cache_key,
            also_in=targets.aliases("dynamo_utils"),
        )
    ]


IMPLEMENTATION = Implementation(patches)
