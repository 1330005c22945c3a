"""The same promotion for the torch backend's nn, math, linalg and image ops.

Loss functions (``binary_crossentropy(target, output)``), attention, normalization
and segment ops take several tensors too; their multi-tensor functions get the
numpy family's wrapper. Convolutions also gather a sharded kernel first: torch's
DTensor convolution rule computes with the local kernel shard but labels the
output Replicate, which gives wrong shapes (``The size of tensor a (2) must
match the size of tensor b (4)``) or wrong values.
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
# Convolutions and the positions of their kernels.
CONVOLUTIONS = {
    "conv": (1,),
    "depthwise_conv": (1,),
    "conv_transpose": (1,),
    "separable_conv": (1, 2),
}


def replicated_kernel(kernel: Any) -> Any:
    """A sharded kernel gathered to Replicate (differentiable); others unchanged."""
    from torch.distributed.tensor import Replicate, Shard

    from keras_dtensor_fix.dtensor import DTensor
    from keras_dtensor_fix.patches._values import variable_class

    if isinstance(kernel, variable_class()):
        kernel = kernel.value
    if isinstance(kernel, DTensor) and any(
        isinstance(p, Shard) for p in kernel.placements
    ):
        mesh = kernel.device_mesh
        return kernel.redistribute(mesh, [Replicate()] * mesh.ndim)
    return kernel


def make_conv_wrapper(name: str, positions: tuple[int, ...]):
    promote = make_wrapper(name, elementwise=False)

    def wrapper(wrapped, instance, args, kwargs):
        args = tuple(
            replicated_kernel(v) if i in positions else v for i, v in enumerate(args)
        )
        for key in ("kernel", "depthwise_kernel", "pointwise_kernel"):
            if key in kwargs:
                kwargs = {**kwargs, key: replicated_kernel(kwargs[key])}
        return promote(wrapped, instance, args, kwargs)

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
            wrapper = make_conv_wrapper(name, CONVOLUTIONS[name])
        elif name == "dot_product_attention":
            wrapper = make_attention_wrapper(inspect.signature(getattr(module, name)))
        else:
            wrapper = make_wrapper(name, elementwise=False)
        result.append(Patch(FAMILY, module.__name__, name, wrapper, gated=True))
    return result
