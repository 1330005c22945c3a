"""Keras dense layers with a sharded kernel, computed on local tensors.

``Dense.call`` and ``EinsumDense.call`` (a product, a bias add, an
activation) cost about 12 dispatched DTensor ops per layer. Where the kernel
and bias placements have a local form (column or row parallel, a
batch-sharded input) the layer runs as
:func:`~keras_dtensor_fix.dtensor.einsum.local_dense` on the local tensors.
"""

from __future__ import annotations

import types
from typing import Any

from keras_dtensor_fix.dtensor import DTensor
from keras_dtensor_fix.dtensor.einsum import linear_equation, local_dense
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require
from keras_dtensor_fix.engine.state import compiling
from keras_dtensor_fix.ops.first_call import FirstCall
from keras_dtensor_fix.ops.values import resolve

#: Keras activations (``keras.activations.<name>``) by how far they reach.
#: Any other callable runs locally only where the output is whole everywhere.
ELEMENTWISE = tuple(
    "celu elu exponential gelu hard_shrink hard_sigmoid hard_silu hard_tanh "
    "leaky_relu linear log_sigmoid mish relu relu6 selu sigmoid silu soft_shrink "
    "softplus softsign sparse_plus sparse_sigmoid squareplus tanh tanh_shrink".split()
)
LAST_AXIS = ("glu", "log_softmax", "softmax", "sparsemax")

_SCOPES: dict[Any, str] = {}
#: Each layer's first local call, checked against DTensor's path.
FIRST = FirstCall("the layers family's local dense call")


def activation_scope(activation: Any) -> str:
    """``"elementwise"``, ``"last"`` or ``"whole"``: see :data:`ELEMENTWISE`."""
    if not _SCOPES:
        activations = targets.keras_object("activations")
        for names, scope in ((ELEMENTWISE, "elementwise"), (LAST_AXIS, "last")):
            for name in names:
                function = getattr(activations, name, None)
                if function is not None:
                    _SCOPES[function] = scope
    try:
        return _SCOPES.get(activation, "whole")
    except TypeError:  # unhashable callable
        return "whole"


def _dense_call(wrapped, instance, args, kwargs):
    """``Dense.call`` (``EinsumDense.call``: the layer's equation) on local tensors."""
    kernel = getattr(instance, "_kernel", None)
    if (
        compiling()
        or not isinstance(getattr(kernel, "_value", None), DTensor)
        or getattr(instance, "lora_enabled", False)
        or getattr(instance, "quantization_mode", None) is not None
        or len(args) + len(kwargs) < 1
    ):
        return wrapped(*args, **kwargs)

    def local() -> Any:
        inputs = resolve(args[0] if args else kwargs.get("inputs"))
        equation = getattr(instance, "equation", None)  # EinsumDense's own
        if not isinstance(equation, str):
            equation = linear_equation(getattr(inputs, "ndim", 0))
        if equation is None:
            return None
        activation = instance.activation
        scope = "elementwise" if activation is None else activation_scope(activation)
        kernel, bias = resolve(instance.kernel), resolve(instance.bias)
        return local_dense(equation, inputs, kernel, bias, activation, scope)

    return FIRST.run(instance, local, lambda: wrapped(*args, **kwargs))


def patches(module: types.ModuleType) -> list[Patch]:
    name = "EinsumDense" if module.__name__ == targets.EINSUM_DENSE else "Dense"
    call = require(module, f"{name}.call")
    # traced: a plain function, cheaper to look up on every call than a proxy.
    return [Patch(module.__name__, call, _dense_call, gated=True, traced=True)]


IMPLEMENTATION = Implementation(patches, after_revert=FIRST.forget)
