"""Whether an error comes from torch.compile itself."""

from __future__ import annotations

import traceback

#: Where torch runs a compiled graph: an error raised there on the first call
#: is torch's (a DTensor output aliasing an input after a graph break: "as_strided
#: not supported with DTensor": torch 2.13, pytorch/pytorch#184002), not the
#: step's, which dynamo met while tracing.
_COMPILED_RUNTIME = ("torch/_functorch/_aot_autograd/", "torch/_inductor/")


def compile_failure(error: BaseException) -> bool:
    """Whether ``error`` is dynamo's or inductor's own; an error of the code itself,
    when traced, raises again at the eager retry."""
    import torch._dynamo.exc as exc

    if isinstance(error, exc.TorchDynamoException):
        return True
    # An assertion inside dynamo's own checks (DTensor outputs it expected as
    # fake tensors) is not wrapped in its exception types.
    files = _traceback_files(error)
    return bool(files) and "torch/_dynamo/" in files[-1]


def in_compiled_runtime(error: BaseException) -> bool:
    """Whether ``error`` was raised inside torch's runner of a compiled graph."""
    return any(
        part in name for name in _traceback_files(error) for part in _COMPILED_RUNTIME
    )


def _traceback_files(error: BaseException) -> list[str]:
    frames = traceback.extract_tb(error.__traceback__)
    return [frame.filename.replace("\\", "/") for frame in frames]
