"""keras-hub causal LM backbones get ``get_layout_map(mesh)`` where they have none.

keras-hub's ``Backbone`` base class gets a ``get_layout_map`` classmethod
(:func:`keras_dtensor_fix.hub.layouts.get_layout_map`): a backbone with a row
in ``hub.layouts.ROWS`` (or a subclass of one) returns its layout, any other
raises an error saying what to write by hand. Backbones with their own
(Gemma, Llama, Qwen, the MoEs) keep theirs: they override the base's. Set
with ``state.set_attribute``, so deactivation deletes it.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import set_attribute
from keras_dtensor_fix.hub import layouts

_ADDED: list[str] = []


def patches(module: types.ModuleType) -> list[Patch]:
    if not isinstance(getattr(module, "Backbone", None), type):
        raise LookupError("Backbone")
    return []  # nothing wrapped: after_apply adds the method


def _get_layout_map(
    cls: type,
    device_mesh: Any,
    model_parallel_dim_name: str = "model",
    data_parallel_dim_name: str = "batch",
) -> Any:
    return layouts.get_layout_map(
        cls, device_mesh, model_parallel_dim_name, data_parallel_dim_name
    )


_get_layout_map.__doc__ = layouts.get_layout_map.__doc__


def _after_apply() -> None:
    (name,) = targets.modules("hub_backbone")
    cls = getattr(sys.modules.get(name), "Backbone", None)
    if cls is None or "get_layout_map" in vars(cls):
        return  # a keras-hub whose base has one keeps it
    set_attribute(cls, "get_layout_map", classmethod(_get_layout_map))
    _ADDED[:] = [cls_name for _, cls_name in layouts.ROWS]


def _after_revert() -> None:
    _ADDED.clear()


def _notes() -> list[str]:
    if not _ADDED:
        return []
    return [f"get_layout_map(mesh) added to keras-hub's {', '.join(_ADDED)}"]


IMPLEMENTATION = Implementation(
    patches, after_apply=_after_apply, after_revert=_after_revert, notes=_notes
)
