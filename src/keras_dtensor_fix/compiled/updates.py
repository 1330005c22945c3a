"""Whether a model's optimizers counted a step: may a failed step run again?

A compiled step failing inside torch's runner of its graph (pytorch/pytorch#143134) runs
again eagerly only where no optimizer updated in it. Its random draws and metric updates
are put back first (:func:`kept`, :func:`rewind`)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

Marks = list[tuple[Any, torch.Tensor]]
#: model -> its seed generators' states (found once: a step adds none).
_SEEDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def marks(model: Any) -> Marks:
    """Each optimizer the model holds (any attribute with ``iterations``) with a copy of
    its step count, kept on the device."""
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


def _state_variables(model: Any) -> list[Any]:
    """Seed generator states and metric variables."""
    seeds = _SEEDS.get(model)
    if seeds is None:
        seeds = [v for v in model.variables if "seed_generator" in v.path]
        _SEEDS[model] = seeds
    return seeds + list(model.metrics_variables)


def _local(variable: Any) -> torch.Tensor:
    value = variable.value
    return getattr(value, "_local_tensor", value)


def kept(model: Any) -> Marks:
    """Copies of what a step changes besides weights and optimizers."""
    try:
        return [(v, _local(v).detach().clone()) for v in _state_variables(model)]
    except Exception:  # noqa: BLE001 - a model without them keeps nothing
        return []


def rewind(taken: Marks) -> None:
    """Put back what :func:`kept` copied."""
    with torch.no_grad():
        for variable, before in taken:
            _local(variable).copy_(before)
