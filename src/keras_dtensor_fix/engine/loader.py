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

__all__ = [
    "Family",
    "families",
    "from_module",
    "import_implementation",
    "register",
]

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
    key: object = None  # what registered it (a family module)


def _from_row(row: _table.Family) -> Family:
    modules = tuple(
        dict.fromkeys(name for kind in row.kinds for name in targets.modules(kind))
    )
    source = f"{PATCHES}.{row.implementation}"
    return Family(row.name, modules, source, row.gated, row.preload)


_families: list[Family] | None = None
_extra: list[Family] = []


def families() -> list[Family]:
    """The table's families (implementations not imported yet), then registered."""
    global _families
    if _families is None:
        _families = [_from_row(row) for row in _table.FAMILIES]
    return _families + _extra


def _check(found: object, source: str) -> Implementation:
    if not isinstance(found, Implementation):
        raise TypeError(
            f"{source}.IMPLEMENTATION is {type(found).__name__}, not "
            "keras_dtensor_fix.engine.contract.Implementation"
        )
    return found


def import_implementation(family: Family) -> None:
    """Import ``family``'s implementation; on failure say why in ``error``, raise."""
    try:
        module = importlib.import_module(family.source)
        found = getattr(module, "IMPLEMENTATION", None)
        family.implementation = _check(found, family.source)
    except Exception as exc:
        family.error = f"import failed: {type(exc).__name__}: {exc}"
        raise


def from_module(module: types.ModuleType) -> Family:
    """A family from a module with ``FAMILY``, ``MODULES`` and ``patches`` (optional:
    ``after_apply``, ``after_revert``, ``notes``, ``GATED``)."""
    missing = [n for n in ("FAMILY", "MODULES", "patches") if not hasattr(module, n)]
    if missing or not callable(getattr(module, "patches", None)):
        what = f"missing {', '.join(missing)}" if missing else "patches not callable"
        raise TypeError(f"{module!r}: invalid family module: {what}")
    implementation = Implementation(
        module.patches,
        getattr(module, "after_apply", None),
        getattr(module, "after_revert", None),
        getattr(module, "notes", None),
    )
    return Family(
        str(module.FAMILY),
        tuple(module.MODULES),
        module.__name__,
        bool(getattr(module, "GATED", True)),
        implementation=implementation,
        key=module,
    )


def register(family: Family) -> bool:
    """Add ``family`` after the table's; False if its module was added before."""
    if any(other.key is family.key for other in _extra):
        return False
    _extra.append(family)
    return True
