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
KINDS = ("nn", "math", "linalg", "image", "core")
MODULES = tuple(f"keras.src.backend.torch.ops.{k}" for k in KINDS) + tuple(
    f"keras.src.backend.torch.{k}" for k in KINDS
)
# The core module's own functions that write one tensor into another; its
# other multi-tensor functions are the numpy module's (``numpy`` family).
CORE = frozenset({"slice_update"})
# Packages that re-export core's functions with ``from .core import name``.
CORE_ALSO_IN = ("keras.src.backend.torch.ops", "keras.src.backend.torch")
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


def make_update_wrapper(signature: inspect.Signature):
    """``slice_update(inputs, start_indices, updates)`` across DTensor layouts.

    keras-hub's ``generate()`` writes DTensor keys and values into a cache
    made with ``ops.zeros`` (plain), where DTensor refuses the in-place copy
    ("in-place operations that require placement changes are not
    supported"). The write runs on local tensors in the updates' placements
    (:func:`~keras_dtensor_fix.dtensor.update_in_place_of`), so a head-sharded
    cache stays sharded from the first step on.
    """
    from keras_dtensor_fix.dtensor import update_in_place_of, wrap_local
    from keras_dtensor_fix.patches._values import full_value, resolve

    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        found = update_in_place_of(
            resolve(bound.arguments["inputs"]), resolve(bound.arguments["updates"])
        )
        if found is None:
            return wrapped(*args, **kwargs)
        mesh, inputs, updates, placements = found
        bound.arguments["inputs"], bound.arguments["updates"] = inputs, updates
        bound.arguments["start_indices"] = full_value(bound.arguments["start_indices"])
        return wrap_local(wrapped(*bound.args, **bound.kwargs), mesh, placements)

    return wrapper


def make_attention_wrapper(signature: inspect.Signature):
    """``dot_product_attention`` per rank on batch- and head-sharded shards.

    Keras's torch implementation moves DTensor operands to their local shards
    with ``hasattr(key, "to_local")``, which dynamo answers False for, so the
    compiled step mixes a local query with DTensor keys; and it takes a mask's
    whole local tensor, whatever its placements, next to a batch-sharded
    query. Here query, key and value keep the query's batch (dim 0) and head
    (dim 2) shards and are gathered on anything else (attention needs every
    key position); a mask or bias, aligned with torch's (batch, heads, query,
    key) from the right, takes the matching shards. The result comes back as
    a DTensor with the query's placements.
    """
    from torch.distributed.tensor import Replicate, Shard

    from keras_dtensor_fix.dtensor import DTensor, replicate
    from keras_dtensor_fix.patches._values import resolve

    def kept(placement: Any) -> Any:
        return placement if placement in (Shard(0), Shard(2)) else Replicate()

    def mask_placement(placement: Any, mask: Any, query: Any) -> Any:
        # Keras's query is (batch, seq, heads, dim); the mask broadcasts
        # against (batch, heads, seq, seq).
        dim = {0: mask.ndim - 4, 2: mask.ndim - 3}.get(getattr(placement, "dim", -1))
        if dim is None or dim < 0 or mask.shape[dim] == 1:
            return Replicate()
        return Shard(dim)

    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        query = resolve(bound.arguments["query"])
        if not isinstance(query, DTensor):
            return wrapped(*args, **kwargs)
        mesh = query.device_mesh
        placements = tuple(kept(p) for p in query.placements)
        for name in ("query", "key", "value", "bias", "mask"):
            tensor = resolve(bound.arguments.get(name))
            if tensor is None:
                continue
            if not isinstance(tensor, DTensor):
                tensor = replicate(tensor, mesh)  # a plain operand: the full value
            target = placements
            if name in ("bias", "mask"):
                target = tuple(mask_placement(p, tensor, query) for p in placements)
            if tuple(tensor.placements) != target:
                tensor = tensor.redistribute(mesh, target)
            bound.arguments[name] = tensor.to_local()
        output = wrapped(*bound.args, **bound.kwargs)
        return DTensor.from_local(output, mesh, placements, run_check=False)

    return wrapper


def patches(module: types.ModuleType) -> list[Patch]:
    result = []
    core = module.__name__.endswith(".core")
    for name in sorted(CORE) if core else target_names(module):
        if core:
            wrapper = make_update_wrapper(inspect.signature(getattr(module, name)))
        elif name in CONVOLUTIONS:
            wrapper = make_conv_wrapper(name, inspect.signature(getattr(module, name)))
        elif name == "dot_product_attention":
            wrapper = make_attention_wrapper(inspect.signature(getattr(module, name)))
        else:
            wrapper = make_wrapper(name, elementwise=False)
        also = CORE_ALSO_IN if core else ()
        result.append(
            Patch(FAMILY, module.__name__, name, wrapper, also_in=also, gated=True)
        )
    return result
