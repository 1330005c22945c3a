"""keras-hub ``generate()`` under ModelParallel: compiled or on local tensors.

``CausalLM.make_generate_function`` is wrapped: under a ModelParallel
distribution each ``generate()`` call runs with the model's token step
compiled (``jit_compile=True``: :mod:`keras_dtensor_fix.generation.tokens`)
or, eagerly, with its decoder blocks and token calls on local tensors where
their layouts allow (:mod:`keras_dtensor_fix.generation.local`). Without
ModelParallel keras-hub's own generation stands, so a one-device script
generates exactly as it does without the plugin.
"""

from __future__ import annotations

import types
from typing import Any

from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import model_parallel
from keras_dtensor_fix.generation import local, tokens


def _make_generate_function(wrapped, instance, args, kwargs):
    function = wrapped(*args, **kwargs)
    if tokens.compiles(instance):
        context = tokens.tokens_compiled
    elif model_parallel() is not None:
        context = local.eager_local
    else:
        return function

    def generate_function(*call_args: Any, **call_kwargs: Any) -> Any:
        with context(instance) as inputs:
            if inputs is not None:
                call_args = inputs(call_args)
            return function(*call_args, **call_kwargs)

    return generate_function


def patches(module: types.ModuleType) -> list[Patch]:
    cls = getattr(module, "CausalLM", None)
    if not callable(getattr(cls, "make_generate_function", None)):
        raise LookupError("CausalLM.make_generate_function")
    return [
        Patch(
            module.__name__, "CausalLM.make_generate_function", _make_generate_function
        )
    ]


IMPLEMENTATION = Implementation(patches, after_revert=tokens.forget)
