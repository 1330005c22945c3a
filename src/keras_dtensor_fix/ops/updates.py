"""Whether a model's optimizers counted a step: may a failed step run again?

A compiled step that fails inside torch's runner of its graph (a backward
whose tangent's DTensor metadata torch guessed wrong) can run again eagerly
only where no optimizer applied an update in it: the eager retry would apply
that update twice.
"""

from __future__ import annotations

from typing import Any

import torch

Marks = list[tuple[Any, torch.Tensor]]


def marks(model: Any) -> Marks:
    """Each optimizer the model holds, with a copy of its step count.

    ``compile()``'s optimizer and any other attribute with ``iterations``
    (a custom ``train_step``'s, a GAN's two). The copies stay on the device:
    nothing synchronises unless a step fails.
    """
    found = []
    seen: set[int] = set()
    for value in vars(model).values():
        try:
            counter = getattr(getattr(value, "iterations", None), "value", None)
        except Exception:  # noqa: BLE001 - a property that raises holds no count
            continue
        if isinstance(counter, torch.Tensor) and id(counter) not in seen:
            seen.add(id(counter))
            local = getattr(counter, "_local_tensor", counter)
            found.append((counter, local.detach().clone()))
    return found


def none_since(taken: Marks) -> bool:
    """Whether no optimizer has counted a step since ``taken``."""
    return all(
        torch.equal(getattr(counter, "_local_tensor", counter), before)
        for counter, before in taken
    )
