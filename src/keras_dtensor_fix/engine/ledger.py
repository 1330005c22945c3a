"""The ledger of patch targets: a row per (family, module, attribute), its state, a
:class:`Cause` and the reason; placeholders for modules not reached."""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from keras_dtensor_fix.engine import config as _config
from keras_dtensor_fix.engine import targets

if TYPE_CHECKING:
    from keras_dtensor_fix.engine.loader import Family

__all__ = [
    "ANY",
    "APPLIED",
    "DISABLED",
    "PENDING",
    "REVERTED",
    "SKIPPED",
    "STATES",
    "Cause",
    "clear_placeholders",
    "EXPECTED",
    "forget",
    "notes",
    "record",
    "rows",
]

APPLIED = "applied"
SKIPPED = "skipped"
DISABLED = "disabled"
PENDING = "pending"
REVERTED = "reverted"
STATES = (APPLIED, SKIPPED, PENDING, DISABLED, REVERTED)
#: Attribute (or module) column of a row that stands for a whole module.
ANY = "*"


class Cause(enum.StrEnum):
    """Why a row is in its state (a row's ``cause``)."""

    WRAPPED = "wrapped"
    RESTORED = "restored"
    DISABLED = "disabled"  # by KERAS_DTENSOR_FIX_DISABLE
    NOT_ACTIVE = "not_active"  # the fix is off
    NOT_IMPORTED = "not_imported"  # the module is not imported yet
    GATE_UNDECIDED = "gate_undecided"  # Keras not far enough imported
    # Skipped, and expected on a healthy install (see EXPECTED).
    GATE_CLOSED = "gate_closed"  # not the torch backend, or no DTensor support
    OTHER_LAYOUT = "other_layout"  # the module belongs to the other Keras layout
    NOTHING_TO_PATCH = "nothing_to_patch"  # patches() returned nothing
    INHERITED = "inherited"  # its base class's patch covers it
    PATCHED_BY_FAMILY = "patched_by_family"  # an earlier family wrapped it
    # Skipped, unexpected: something this Keras should have is not patched.
    NOT_IN_THIS_KERAS = "not_in_this_keras"  # patches() raised LookupError
    IMPORT_FAILED = "import_failed"  # the family's implementation
    PATCHES_FAILED = "patches_failed"  # patches() raised something else
    NOT_FOUND = "not_found"  # the attribute does not exist
    MODULE_NOT_IMPORTED = "module_not_imported"  # a Patch names another module
    INHERITED_UNPATCHED = "inherited_unpatched"  # its base class is not patched
    ALREADY_WRAPPED = "already_wrapped"  # by another copy of keras_dtensor_fix
    PATCH_FAILED = "patch_failed"  # installing the wrapper raised
    REPLACED = "replaced"  # replaced by someone else after patching: not reverted


#: A row's state by its cause; every other cause is a skip.
STATE: dict[Cause, str] = {
    Cause.WRAPPED: APPLIED,
    Cause.RESTORED: REVERTED,
    Cause.DISABLED: DISABLED,
    Cause.NOT_ACTIVE: PENDING,
    Cause.NOT_IMPORTED: PENDING,
    Cause.GATE_UNDECIDED: PENDING,
}

#: Skips a healthy install has, and the summary's word for each.
EXPECTED: dict[Cause, str] = {
    Cause.INHERITED: "inherited",
    Cause.OTHER_LAYOUT: "other layout",
    Cause.PATCHED_BY_FAMILY: "patched by another family",
    Cause.NOTHING_TO_PATCH: "nothing to patch",
    Cause.GATE_CLOSED: "gate",
}

# (family, module, attribute) -> (cause, reason), as the engine recorded.
_recorded: dict[tuple[str, str, str], tuple[Cause, str]] = {}


def record(family: str, module: str, attribute: str, cause: Cause, reason: str) -> None:
    """Set the row of one target (``attribute`` :data:`ANY`: a whole module)."""
    _recorded[(family, module, attribute)] = (cause, reason)


def forget(family: str, module: str) -> None:
    """Drop a whole-module row: the family now acts on the module itself."""
    _recorded.pop((family, module, ANY), None)


def clear_placeholders() -> None:
    """Drop every whole-module row (on deactivation)."""
    for key in [k for k in _recorded if k[2] == ANY]:
        del _recorded[key]


#: A status row's keys.
COLUMNS = ("family", "module", "attribute", "state", "cause", "reason")


def _row(key: tuple[str, str, str], cause: Cause, reason: str) -> dict[str, str]:
    values = (*key, STATE.get(cause, SKIPPED), cause, reason)
    return dict(zip(COLUMNS, values, strict=True))


def _placeholder(
    family: Family, module: str, cfg: _config.Config, active: bool, gate: Any
) -> tuple[Cause, str]:
    """Why the family has not acted on ``module``."""
    if not cfg.family_enabled(family.name):
        return Cause.DISABLED, f"disabled by {_config.ENV_DISABLE}"
    if not active:
        return Cause.NOT_ACTIVE, "keras_dtensor_fix is not active"
    if family.gated and gate.ok is False:
        return Cause.GATE_CLOSED, gate.reason
    if targets.KERAS in sys.modules and targets.find_spec(module) is None:
        why = f"no such module in this Keras (layout {targets.layout()})"
        return Cause.OTHER_LAYOUT, why
    return Cause.NOT_IMPORTED, "module not imported yet"


def rows(
    families: Iterable[Family], cfg: _config.Config | None, active: bool
) -> list[dict[str, str]]:
    """One row per (family, module, attribute), plus one ``pending`` row (``"*"``) per
    module not imported, skipped or disabled."""
    cfg = cfg if cfg is not None else _config.load(warn=False)
    gate = targets.gate()
    out: list[dict[str, str]] = []
    for family in families:
        if family.error is not None:
            key = (family.name, family.source, ANY)
            out.append(_row(key, Cause.IMPORT_FAILED, family.error))
            continue
        recorded = [k for k in _recorded if k[0] == family.name]
        modules = dict.fromkeys([*family.modules, *(m for _, m, _ in recorded)])
        for module in modules:
            keys = [k for k in recorded if k[1] == module]
            if keys:
                out.extend(_row(k, *_recorded[k]) for k in keys)
            else:
                why = _placeholder(family, module, cfg, active, gate)
                out.append(_row((family.name, module, ANY), *why))
    return out


def notes(families: Iterable[Family]) -> list[str]:
    """What the imported family implementations say about this Keras build."""
    found: list[str] = []
    for family in families:
        if (function := family.implementation and family.implementation.notes) is None:
            continue
        try:
            found.extend(function())
        except Exception as exc:  # noqa: BLE001 - a report must not fail
            found.append(f"{family.name}: notes unavailable ({exc})")
    return found
