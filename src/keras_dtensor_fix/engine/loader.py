"""The family loader: a record per row of :data:`.families.FAMILIES` (and per
:func:`.patcher.register_family`); the only importer of
:mod:`keras_dtensor_fix.patches`, at a family's first Keras module."""

from __future__ import annotations

import importlib
import types
from dataclasses import dataclass

from keras_dtensor_fix.engine import families as _table
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation

__all__ = ["Family", "families", "implementation", "register"]

#: Package of the families' implementation modules.
PATCHES = "keras_dtensor_fix.patches"


@dataclass
class Family:
    """A family as the engine uses it."""

    name: str
    modules: tuple[str, ...]
    source: str  # the implementation's module name
    gated: bool = True
    preload: bool = False  # import ``modules`` once Keras is imported
    implementation: Implementation | None = None
    error: str | None = None  # why the implementation is unusable


def _from_row(row: _table.Family) -> Family:
    modules = tuple(
        dict.fromkeys(name for kind in row.kinds for name in targets.MODULES[kind])
    )
    source = f"{PATCHES}.{row.implementation}"
    return Family(row.name, modules, source, row.gated, row.preload)


_families: list[Family] | None = None
_registered: dict[types.ModuleType, Family] = {}


def families() -> list[Family]:
    """The table's families (implementations not imported yet), then registered."""
    global _families
    if _families is None:
        _families = [_from_row(row) for row in _table.FAMILIES]
    return _families + list(_registered.values())


def implementation(family: Family) -> Implementation | None:
    """``family``'s implementation, imported on first use; a failure says why in
    ``error`` and raises (once: later calls return None)."""
    if family.implementation is None and family.error is None:
        try:
            module = importlib.import_module(family.source)
            found = getattr(module, "IMPLEMENTATION", None)
            if not isinstance(found, Implementation):
                raise TypeError(
                    f"{family.source}.IMPLEMENTATION is {type(found).__name__}, not "
                    "keras_dtensor_fix.engine.contract.Implementation"
                )
            family.implementation = found
        except Exception as exc:
            family.error = f"import failed: {type(exc).__name__}: {exc}"
            raise
    return family.implementation


def register(module: types.ModuleType) -> Family | None:
    """A family from a module with ``FAMILY``, ``MODULES`` and ``patches`` (optional:
    ``after_apply``, ``after_revert``, ``notes``, ``GATED``), added after the table's;
    None if that module was added before."""
    missing = [n for n in ("FAMILY", "MODULES", "patches") if not hasattr(module, n)]
    if missing or not callable(getattr(module, "patches", None)):
        what = f"missing {', '.join(missing)}" if missing else "patches not callable"
        raise TypeError(f"{module!r}: invalid family module: {what}")
    if module in _registered:
        return None
    hooks = (getattr(module, n, None) for n in ("after_apply", "after_revert", "notes"))
    _registered[module] = Family(
        str(module.FAMILY),
        tuple(module.MODULES),
        module.__name__,
        bool(getattr(module, "GATED", True)),
        implementation=Implementation(module.patches, *hooks),
    )
    return _registered[module]
