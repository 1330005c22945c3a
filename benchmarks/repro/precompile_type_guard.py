"""torch's caching precompile cannot save a function that asks a tensor's type.

Dynamo's caching precompile (``torch._dynamo.config.caching_precompile``,
``TORCH_CACHING_PRECOMPILE=1``) saves a compiled function's bytecode and
guards so that a new process skips dynamo's trace: what is left of a warm
compiled start once the FX graph and AOT autograd caches hit (see
``benchmarks/results/2026-11-28-precompile.md``). Its guards must serialize.
A compiled function that compares a tensor attribute's type with a class
(``type(h.value) is torch.Tensor``) gets a ``CLASS_MATCH`` guard on
``type(L['h'].value)``, which torch 2.13 lists among the guards it cannot
serialize (``CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES``),
although the class is an importable one. With ``strict_precompile`` the
compile raises ``PackageError: CLASS_MATCH guard cannot be serialized``;
without it the package is dropped and the next process traces again. Keras's
train step has such guards (the type of its metric and optimizer variables'
values, and under ModelParallel the type of the batch), so no Keras step can
be saved. Pure torch, one process:

    python benchmarks/repro/precompile_type_guard.py
"""

from __future__ import annotations

import torch

torch._dynamo.config.caching_precompile = True
torch._dynamo.config.strict_precompile = True


class Holder:
    def __init__(self) -> None:
        self.value = torch.nn.Parameter(torch.ones(2))


def plain(x: torch.Tensor, holder: Holder) -> torch.Tensor:
    return x * holder.value


def reads_type(x: torch.Tensor, holder: Holder) -> torch.Tensor:
    if type(holder.value) is torch.Tensor:  # as Keras asks of a variable's value
        return x
    return x * holder.value


def main() -> None:
    for function in (plain, reads_type):
        compiled = torch.compile(function, backend="eager")
        try:
            compiled(torch.ones(2), Holder())
        except Exception as err:  # noqa: BLE001 - what torch raises is the point
            print(f"{function.__name__}: {type(err).__name__}: {str(err).strip()}")
        else:
            print(f"{function.__name__}: compiled, its package kept")


if __name__ == "__main__":
    main()
