"""DTensor's tensor-subclass methods, never compiled as frames of their own.

A custom ``train_step``'s ``loss.backward()`` is a graph break: it runs
eagerly with dynamo's frame hook still on, so every Python frame the
backward enters is compiled on its own. AOT autograd's runtime rebuilds each
DTensor gradient and tangent of a compiled graph through DTensor's subclass
protocol (``__tensor_unflatten__``, ``__coerce_same_metadata_as_tangent__``):
dynamo (torch 2.13) compiled each as a frame, once per shape (compiled steps
trace with static shapes), up to its recompile limit (8, warned), a graph
and guards per shape for code that upstream's eager step runs as plain
Python. Skipped with their callees (dynamo's frame execution strategy, by
code object) they run as plain Python; a graph that calls them still traces
them (the strategy acts on frames, not on inlined calls). Applied when a
compiled ModelParallel step is built, undone by ``deactivate()``.
"""

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


def helper_codes() -> list[types.CodeType]:
    """The code objects of :data:`HELPERS` that this torch's DTensor has."""
    from torch.distributed.tensor import DTensor

    functions = [getattr(DTensor, name, None) for name in HELPERS]
    return [f.__code__ for f in functions if hasattr(f, "__code__")]


def skip() -> None:
    """Dynamo runs :data:`HELPERS` and what they call without compiling them.

    Set again at each call (each compiled step built): ``torch._dynamo.reset()``
    clears what it stored on a code object it has compiled.
    """
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    for code in helper_codes():
        strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        set_code_exec_strategy(code, strategy)
        if code not in _SKIPPED:
            _SKIPPED.append(code)


def restore() -> None:
    """Dynamo's default for the helpers again (``deactivate()``)."""
    if not _SKIPPED:
        return
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    while _SKIPPED:
        code = _SKIPPED.pop()
        strategy = FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT)
        set_code_exec_strategy(code, strategy)
