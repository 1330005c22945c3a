"""keras-hub ``generate()`` under ModelParallel: compiled or on local tensors.

Each call runs in :func:`keras_dtensor_fix.generation.tokens.generating`'s context;
without ModelParallel keras-hub's own generation stands.
"""

from __future__ import annotations

import types
from typing import Any

from keras_dtensor_fix.engine.contract import Implementation, Patch, require
from keras_dtensor_fix.generation import tokens


def _make_generate_function(wrapped, instance, args, kwargs):
    function = wrapped(*args, **kwargs)
    context = tokens.generating(instance)
    if context is None:
        return function

    def generate_function(*call_args: Any, **call_kwargs: Any) -> Any:
        with context(instance) as inputs:
            if inputs is not None:
                call_args = inputs(call_args)
            return function(*call_args, **call_kwargs)

    return generate_function


def patches(module: types.ModuleType) -> list[Patch]:
    name = require(module, "CausalLM.make_generate_function", "this keras-hub moved it")
    return [Patch(module.__name__, name, _make_generate_function)]


IMPLEMENTATION = Implementation(patches, after_revert=tokens.forget)
