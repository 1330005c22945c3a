"""LSTM and GRU with sharded kernels: the weights gathered once per call.

The torch backend's ``lstm``/``gru`` split each time step's gates with
``torch.chunk``: with a kernel sharded on its gate columns DTensor gathers it
every step, and compiled (torch 2.13) such a loop's gradients come out
wrong. Gathering the kernels and bias once per call (as FSDP does) leaves the
loop on replicated weights; their gradients go back to the shards by a local
slice. A masked call takes Keras's generic loop, kept eager.
"""

from __future__ import annotations

import inspect
import types

from keras_dtensor_fix.dtensor import DTensor, gather_axis, is_replicated
from keras_dtensor_fix.engine.contract import Implementation, Patch

ENTRIES = ("lstm", "gru")
WEIGHTS = ("kernel", "recurrent_kernel", "bias")


def make_wrapper(signature: inspect.Signature):
    def wrapper(wrapped, instance, args, kwargs):
        bound = signature.bind(*args, **kwargs)
        for name in WEIGHTS:
            value = bound.arguments.get(name)
            value = getattr(value, "value", value)  # a Keras Variable's tensor
            if isinstance(value, DTensor) and not is_replicated(value):
                bound.arguments[name] = gather_axis(value, None)
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
