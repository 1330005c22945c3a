"""Promote plain tensors that meet a DTensor in the torch backend's numpy ops.

Targets are found systematically: every public function of the backend numpy
module that can take two or more tensors (two or more positional parameters,
``*args``, or a sequence of tensors). A wrapper's fast path (no DTensor among
the arguments) calls the original at once.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

from keras_dtensor_fix.engine import Patch

FAMILY = "numpy"
MODULES = ("keras.src.backend.torch.ops.numpy", "keras.src.backend.torch.numpy")
# Modules that bind numpy functions with ``from ...numpy import name``.
ALSO_IN = (
    "keras.src.backend.torch.ops.nn",
    "keras.src.backend.torch.ops.math",
    "keras.src.backend.torch.ops.core",
    "keras.src.backend.torch.ops.linalg",
    "keras.src.backend.torch.ops.image",
    "keras.src.backend.torch.nn",
    "keras.src.backend.torch.math",
    "keras.src.backend.torch.core",
    "keras.src.backend.torch.linalg",
    "keras.src.backend.torch.image",
    "keras.src.backend.torch.random",
    "keras.src.backend.torch.rnn",
)
SEQUENCE_PARAMS = frozenset({"xs", "arrays", "tensors", "condlist", "choicelist"})
# Binary ops whose operands broadcast elementwise: a plain operand of one
# rank's shard size is refused there. Other ops promote without that check.
NOT_ELEMENTWISE = frozenset(
    {
        "matmul",
        "dot",
        "inner",
        "outer",
        "kron",
        "tensordot",
        "vdot",
        "cross",
        "correlate",
        "append",
        "isin",
        "einsum",
        "digitize",
        "searchsorted",
    }
)


# Public helpers of the numpy module, not ops: only its (wrapped) ops call them,
# after promoting, so a wrapper there would check every binary op twice.
HELPERS = frozenset({"convert_to_tensors_of_same_dtype"})

# Contractions: over a sharded axis they return Partial sums, reduced at once.
CONTRACTIONS = frozenset({"matmul", "dot", "inner", "tensordot", "vdot", "einsum"})


def takes_several_tensors(fn: Any) -> bool:
    """Whether ``fn``'s signature lets it take two or more tensors."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        return True
    if positional and positional[0].name in SEQUENCE_PARAMS:
        return True
    return len(positional) >= 2


def target_names(module: types.ModuleType) -> list[str]:
    """Public functions defined in ``module`` that take two or more tensors."""
    return sorted(
        name
        for name, fn in vars(module).items()
        if not name.startswith("_")
        and name not in HELPERS
        and inspect.isfunction(fn)
        and fn.__module__ == module.__name__
        and takes_several_tensors(fn)
    )


def _is_elementwise(name: str, fn: Any) -> bool:
    if name in NOT_ELEMENTWISE:
        return False
    params = list(inspect.signature(fn).parameters)[:2]
    return params in (["x1", "x2"], ["x", "y"]) or name in ("where", "clip")


def _axis(args: tuple, kwargs: dict) -> Any:
    """The ``axis`` argument of ``take(x, indices, axis=None)``."""
    return args[2] if len(args) > 2 else kwargs.get("axis")


def make_wrapper(name: str, elementwise: bool):
    """The wrapper for one numpy op: fast path, or promote then call.

    A contraction's Partial result is reduced where it is made (see
    :func:`~keras_dtensor_fix.dtensor.reduce_partial`).
    """
    from keras_dtensor_fix.dtensor import (
        DTensor,
        gather_axes_splitting,
        reduce_masked,
        reduce_partial,
        replicate_result,
        replicated_locals,
        vocab_parallel_lookup,
    )
    from keras_dtensor_fix.einsum import local_einsum, local_matmul
    from keras_dtensor_fix.patches._values import promote_call, resolve, variable_class

    keras_variable = variable_class()

    def distributed(value: Any) -> bool:
        if isinstance(value, DTensor):
            return True
        if isinstance(value, keras_variable):
            return isinstance(value._value, DTensor)
        if isinstance(value, (list, tuple)):
            return any(distributed(v) for v in value)
        return False

    import torch

    # Types that can never hold a DTensor: one set lookup per argument.
    plain = {torch.Tensor, torch.nn.Parameter, int, float, bool, str, type(None)}

    contraction = name in CONTRACTIONS
    lookup = name == "take"

    def einsum_form(args: tuple) -> Any:
        if args and isinstance(args[0], str):
            return local_einsum(args[0], [resolve(v) for v in args[1:]])
        return None

    def matmul_form(args: tuple) -> Any:
        if len(args) == 2:
            return local_matmul(resolve(args[0]), resolve(args[1]))
        return None

    # DTensor operands whose placements allow it: one local einsum.
    local_form = {"einsum": einsum_form, "matmul": matmul_form}.get(name)

    def replicated_form(wrapped, args, kwargs):
        # Replicated operands and no gradient (a step counter, a metric):
        # the op on local tensors, the result wrapped once.
        resolved = [resolve(v) for v in args]
        names = list(kwargs)
        found = replicated_locals(resolved + [resolve(kwargs[k]) for k in names])
        if found is None:
            return None
        mesh, local = found
        n = len(resolved)
        result = wrapped(*local[:n], **dict(zip(names, local[n:], strict=True)))
        return replicate_result(result, mesh)

    def call(wrapped, args, kwargs):
        if lookup and len(args) >= 2:
            # An embedding lookup: see gather_axes_splitting.
            table = gather_axes_splitting(resolve(args[0]), resolve(args[1]))
            args = (table, *args[1:])
            if torch.compiler.is_compiling() and _axis(args, kwargs) == 0:
                # DTensor's own row-split lookup keeps state a trace cannot.
                found = vocab_parallel_lookup(table, resolve(args[1]))
                if found is not None:
                    return found
        if local_form is not None and not kwargs:
            local = local_form(args)
            if local is not None:
                return reduce_partial(local)
        local = replicated_form(wrapped, args, kwargs)
        if local is not None:
            return local
        result = promote_call(wrapped, args, kwargs, op=name, elementwise=elementwise)
        return reduce_partial(result) if contraction else reduce_masked(result)

    def wrapper(wrapped, instance, args, kwargs):
        for value in args:
            if type(value) not in plain and distributed(value):
                return call(wrapped, args, kwargs)
        if kwargs:
            for value in kwargs.values():
                if type(value) not in plain and distributed(value):
                    return call(wrapped, args, kwargs)
        return wrapped(*args, **kwargs)

    return wrapper


def patches(module: types.ModuleType) -> list[Patch]:
    result = []
    for name in target_names(module):
        fn = getattr(module, name)
        wrapper = make_wrapper(name, _is_elementwise(name, fn))
        result.append(
            Patch(FAMILY, module.__name__, name, wrapper, also_in=ALSO_IN, gated=True)
        )
    return result
