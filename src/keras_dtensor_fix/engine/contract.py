"""The family contract: ``IMPLEMENTATION = Implementation(patches, ...)`` ends each
``patches/<name>.py``; families import it from here, never the engine. Standard library
only."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["Implementation", "Patch", "require", "resolve"]


@dataclass(frozen=True)
class Patch:
    """One attribute to wrap."""

    module: str  # module owning the attribute, e.g. targets.MODULES["numpy"][0]
    attribute: str  # dotted path inside module: "add" or "Adam._parallel_update_step"
    wrapper: Callable[[Any, Any, tuple, dict], Any]  # wrapt wrapper
    also_in: tuple[str, ...] = ()  # modules that bound the same object by name
    # Runs only once sharding is on (``state.note_sharding``); until then wrapt
    # calls the original at C speed.
    gated: bool = False
    # torch.compile runs the wrapper too (``wrappers.traced_method``); by
    # default dynamo traces the original alone.
    traced: bool = False
    # An attribute the target lacks, ``wrapper`` its value; deleted on
    # deactivation, left alone where the target has its own.
    added: bool = False


@dataclass(frozen=True)
class Implementation:
    """What a family exports as ``IMPLEMENTATION``.

    ``patches(module)`` lists one target module's patches (``LookupError``: not in this
    Keras, a warning and a status row); ``after_apply`` runs once per module after them,
    ``after_revert`` on deactivation once per ``after_apply``, ``notes`` for ``status``.
    """

    patches: Callable[[types.ModuleType], Iterable[Patch]]
    after_apply: Callable[[], None] | None = None
    after_revert: Callable[[], None] | None = None
    notes: Callable[[], list[str]] | None = None


def require(
    module: types.ModuleType, attribute: str, why: str = "this Keras moved it"
) -> str:
    """``attribute`` (dotted) where its owner in ``module`` defines it itself (an
    inherited one is not patched there), else ``LookupError``: this build lacks it."""
    owner, name = resolve(module, attribute)
    if name not in getattr(owner, "__dict__", {}):
        raise LookupError(f"{attribute} not found: {why}")
    return attribute


def resolve(module: types.ModuleType | None, attribute: str) -> tuple[Any, str]:
    """The owner of dotted ``attribute`` in ``module`` (None where a class on the path
    is missing) and the last name."""
    *path, name = attribute.split(".")
    owner: Any = module
    for part in path:
        owner = getattr(owner, part, None)
    return owner, name
