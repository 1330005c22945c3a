"""LSTM and GRU with sharded kernels: the weights gathered once per call.

The torch backend's ``lstm``/``gru`` loop over time steps and split each step's
gate pre-activations into gates with ``torch.chunk``. With a kernel sharded on
its gate columns every chunk of every step needs the whole row: DTensor
gathers it each time, and compiled with inductor (``jit_compile=True``, torch
2.13, ``torch.autograd.grad`` traced into the step) the gradients of such a
loop come out wrong. Gathering the sharded kernels, recurrent kernel and bias
once at the start of the call (what FSDP does before a layer runs) leaves the
loop on replicated weights: one all-gather per weight instead of one per step,
and compiled gradients equal eager ones. Their gradients go back to the
shards' placements by a local slice. A Keras mask sends the layer to Keras's
generic loop instead, which the ``compile`` family keeps eager.
"""

from __future__ import annotations

import inspect
import types

from keras_dtensor_fix.dtensor import DTensor, gather_axis
from keras_dtensor_fix.engine.contract import Implementation, Patch

ENTRIES = ("lstm", "gru")
WEIGHTS = ("kernel", "recurrent_kernel", "bias")


def _value(weight):
    """A Keras Variable's tensor, or the tensor itself."""
    return getattr(weight, "value", weight)


def make_wrapper(signature: inspect.Signature):
    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        gathered = False
        for name in WEIGHTS:
            value = _value(bound.arguments.get(name))
            if isinstance(value, DTensor) and not all(
                p.is_replicate() for p in value.placements
            ):
                bound.arguments[name] = gather_axis(value, None)
                gathered = True
        if not gathered:
            return wrapped(*args, **kwargs)
        return wrapped(*bound.args, **bound.kwargs)

    return wrapper


def patches(module: types.ModuleType) -> list[Patch]:
    found = [name for name in ENTRIES if hasattr(module, name)]
    if not found:
        raise LookupError("rnn.lstm / rnn.gru not found")
    result = []
    for name in found:
        signature = inspect.signature(getattr(module, name))
        if not set(WEIGHTS) <= set(signature.parameters):
            raise LookupError(f"rnn.{name} takes no {WEIGHTS}")
        result.append(Patch(module.__name__, name, make_wrapper(signature), gated=True))
    return result


IMPLEMENTATION = Implementation(patches)
