"""The same promotion for the torch backend's nn, math, linalg and image ops.

Loss functions (``binary_crossentropy(target, output)``), attention, normalization
and segment ops take several tensors too; their multi-tensor functions get the
numpy family's wrapper. Convolutions run per rank with gathered kernels (see
:func:`make_conv_wrapper`).
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from keras_dtensor_fix.engine import Patch
from keras_dtensor_fix.patches.numpy_ops import make_wrapper, target_names

FAMILY = "ops"
KINDS = ("nn", "math", "linalg", "image")
MODULES = tuple(f"keras.src.backend.torch.ops.{k}" for k in KINDS) + tuple(
    f"keras.src.backend.torch.{k}" for k in KINDS
)
# Convolutions and the names of their kernels.
CONVOLUTIONS = {
    "conv": ("kernel",),
    "depthwise_conv": ("kernel",),
    "conv_transpose": ("kernel",),
    "separable_conv": ("depthwise_kernel", "pointwise_kernel"),
}


def make_conv_wrapper(name: str, signature: inspect.Signature):
    """A convolution on DTensors runs per rank on its batch rows, kernels gathered.

    torch's DTensor convolution handles replicated and width-sharded inputs
    only: a kernel sharded on any axis, or activations sharded on channels by
    the sharded bias of the conv before, come out with the wrong shape or
    values. Gathering the kernels (small next to activations) works for every
    layout and every Keras conv layer.
    """
    from keras_dtensor_fix.dtensor import DTensor, batch_parallel_call
    from keras_dtensor_fix.patches._values import resolve

    names = ("inputs", *CONVOLUTIONS[name])

    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        operands = [resolve(bound.arguments[k]) for k in names]
        found = [v for v in operands if isinstance(v, DTensor)]
        if not found:
            return wrapped(*args, **kwargs)
        mesh = found[0].device_mesh
        if any(v.device_mesh != mesh for v in found):
            return wrapped(*args, **kwargs)  # DTensor's own error names them

        def local(value, *kernels):
            for key, kernel in zip(names[1:], kernels, strict=True):
                bound.arguments[key] = kernel
            bound.arguments["inputs"] = value
            return wrapped(*bound.args, **bound.kwargs)

        return batch_parallel_call(local, operands[0], operands[1:], mesh)

    return wrapper


def make_attention_wrapper(signature: inspect.Signature):
    """``dot_product_attention`` on head-sharded DTensors, eager and compiled.

    Keras's torch implementation moves DTensor operands to their local shards
    with ``hasattr(key, "to_local")``, which dynamo answers False for, so the
    compiled step mixes a local query with DTensor keys. Here query, key and
    value take the query's placements and go in as local shards; the result
    comes back as a DTensor with those placements.
    """
    from keras_dtensor_fix.dtensor import DTensor
    from keras_dtensor_fix.patches._values import variable_class

    def value_of(value: Any) -> Any:
        return value.value if isinstance(value, variable_class()) else value

    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        query = value_of(bound.arguments["query"])
        if not isinstance(query, DTensor) or any(
            bound.arguments.get(k) is not None for k in ("bias", "mask")
        ):
            return wrapped(*args, **kwargs)
        mesh, placements = query.device_mesh, tuple(query.placements)
        for name in ("query", "key", "value"):
            tensor = value_of(bound.arguments[name])
            if not isinstance(tensor, DTensor):
                tensor = DTensor.from_local(tensor, mesh, placements, run_check=False)
            elif tuple(tensor.placements) != placements:
                tensor = tensor.redistribute(mesh, placements)
            bound.arguments[name] = tensor.to_local()
        output = wrapped(*bound.args, **bound.kwargs)
        return DTensor.from_local(output, mesh, placements, run_check=False)

    return wrapper


def patches(module: types.ModuleType) -> list[Patch]:
    result = []
    for name in target_names(module):
        if name in CONVOLUTIONS:
            wrapper = make_conv_wrapper(name, inspect.signature(getattr(module, name)))
        elif name == "dot_product_attention":
            wrapper = make_attention_wrapper(inspect.signature(getattr(module, name)))
        else:
            wrapper = make_wrapper(name, elementwise=False)
        result.append(Patch(FAMILY, module.__name__, name, wrapper, gated=True))
    return result
