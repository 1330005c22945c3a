"""DTensor's tensor-subclass methods, never compiled as frames of their own.

After a graph break (a custom step's ``loss.backward()``) AOT autograd's runtime
rebuilds each DTensor gradient through DTensor's subclass protocol with dynamo's frame
hook on: dynamo (torch 2.13) compiled each such method as a frame, once per shape, up to
its recompile limit. Skipped by code object they run as plain Python; a graph that calls
them still traces them."""

from __future__ import annotations

import types

#: DTensor's methods that torch's runtime of a compiled graph calls.
HELPERS = (
    "__tensor_flatten__",
    "__tensor_unflatten__",
    "__coerce_tangent_metadata__",
    "__coerce_same_metadata_as_tangent__",
)

_SKIPPED: list[types.CodeType] = []


def skip() -> None:
    """Dynamo runs :data:`HELPERS` without compiling them; set again at each step built
    (``torch._dynamo.reset()`` clears it)."""
    from torch.distributed.tensor import DTensor

    functions = [getattr(DTensor, name, None) for name in HELPERS]
    codes = [f.__code__ for f in functions if hasattr(f, "__code__")]
    _set(codes, "SKIP")
    _SKIPPED.extend(code for code in codes if code not in _SKIPPED)


def restore() -> None:
    """Dynamo's default for the helpers again."""
    if _SKIPPED:
        _set(_SKIPPED, "DEFAULT")
        _SKIPPED.clear()


def _set(codes: list[types.CodeType], action: str) -> None:
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    both = getattr(FrameAction, action)  # for the frame and the frames it calls
    for code in codes:
        set_code_exec_strategy(code, FrameExecStrategy(both, both))
