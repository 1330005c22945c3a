"""Op handlers that lay out the operands themselves (DTensor has no usable rule for
these ops on Keras's placements): each runs the original per rank and wraps the result,
and always returns."""

from __future__ import annotations

from typing import Any

from keras_dtensor_fix.ops.call import Call
from keras_dtensor_fix.ops.values import full_value, resolve

__all__ = ["CONVOLUTIONS", "attention", "conv", "update"]

#: Convolutions and the names of their kernels.
CONVOLUTIONS: dict[str, tuple[str, ...]] = {
    "conv": ("kernel",),
    "depthwise_conv": ("kernel",),
    "conv_transpose": ("kernel",),
    "separable_conv": ("depthwise_kernel", "pointwise_kernel"),
}


def conv(call: Call) -> Any:
    """A convolution per rank on its batch rows, kernels gathered: torch's DTensor
    convolution handles only replicated and width-sharded inputs."""
    from keras_dtensor_fix.dtensor import DTensor, batch_parallel_call

    names = ("inputs", *CONVOLUTIONS[call.op.name])
    operands = [resolve(call.arguments[k]) for k in names]
    found = [v for v in operands if isinstance(v, DTensor)]
    if not found:
        return call.run()
    mesh = found[0].device_mesh
    if any(v.device_mesh != mesh for v in found):
        return call.run()  # DTensor's own error names them

    def local(value: Any, *kernels: Any) -> Any:
        return call.run(**dict(zip(names, (value, *kernels), strict=True)))

    return batch_parallel_call(local, operands[0], operands[1:], mesh)


def update(call: Call) -> Any:
    """``slice_update(inputs, start_indices, updates)`` across layouts: a KV cache made
    plain gets DTensor writes, which DTensor refuses in place; the write runs on local
    tensors in the updates' placements."""
    from keras_dtensor_fix.dtensor import update_in_place_of, wrap_local

    arguments = call.arguments
    found = update_in_place_of(
        resolve(arguments["inputs"]), resolve(arguments["updates"])
    )
    if found is None:
        return call.run()
    mesh, inputs, updates, placements = found
    start_indices = full_value(arguments["start_indices"])
    result = call.run(inputs=inputs, start_indices=start_indices, updates=updates)
    return wrap_local(result, mesh, placements)


def attention(call: Call) -> Any:
    """``dot_product_attention`` per rank on batch- and head-sharded shards.

    Keras's torch version tests ``hasattr(key, "to_local")``, which dynamo answers False
    (a local query beside DTensor keys), and takes a mask's whole local tensor. Here
    query, key and value keep the query's batch and head shards, gathered on the rest; a
    mask or bias takes the matching shards."""
    from torch.distributed.tensor import Replicate, Shard

    from keras_dtensor_fix.dtensor import DTensor, replicate

    def kept(placement: Any) -> Any:
        return placement if placement in (Shard(0), Shard(2)) else Replicate()

    def mask_placement(placement: Any, mask: Any) -> Any:
        # Keras's query is (batch, seq, heads, dim); the mask broadcasts
        # against (batch, heads, seq, seq).
        dim = {0: mask.ndim - 4, 2: mask.ndim - 3}.get(getattr(placement, "dim", -1))
        if dim is None or dim < 0 or mask.shape[dim] == 1:
            return Replicate()
        return Shard(dim)

    arguments = call.arguments
    query = resolve(arguments["query"])
    if not isinstance(query, DTensor):
        return call.run()
    mesh = query.device_mesh
    placements = tuple(kept(p) for p in query.placements)
    local = {}
    for name in ("query", "key", "value", "bias", "mask"):
        tensor = resolve(arguments.get(name))
        if tensor is None:
            continue
        if not isinstance(tensor, DTensor):
            tensor = replicate(tensor, mesh)  # a plain operand: the full value
        target = placements
        if name in ("bias", "mask"):
            target = tuple(mask_placement(p, tensor) for p in placements)
        if tuple(tensor.placements) != target:
            tensor = tensor.redistribute(mesh, target)
        local[name] = tensor.to_local()
    return DTensor.from_local(call.run(**local), mesh, placements, run_check=False)
