"""keras-hub causal LM backbones get ``get_layout_map(mesh)`` where they have none.

keras-hub's ``Backbone`` base class gets a ``get_layout_map`` classmethod
(:func:`keras_dtensor_fix.hub.layouts.get_layout_map`): a backbone with a row
in ``hub.layouts.ROWS`` (or a subclass of one) returns its layout, any other
raises an error saying what to write by hand. Backbones with their own
(Gemma, Llama, Qwen, the MoEs) keep theirs: they override the base's. An
``added`` patch: deactivation deletes it, and a keras-hub whose base class
has one keeps its own.
"""

from __future__ import annotations

import types
from typing import Any

from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.hub import layouts


def patches(module: types.ModuleType) -> list[Patch]:
    if not isinstance(getattr(module, "Backbone", None), type):
        raise LookupError("Backbone")
    method = classmethod(_get_layout_map)
    return [Patch(module.__name__, "Backbone.get_layout_map", method, added=True)]


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


def _notes() -> list[str]:
    names = ", ".join(cls_name for _, cls_name in layouts.ROWS)
    return [f"get_layout_map(mesh) for keras-hub's {names}"]


IMPLEMENTATION = Implementation(patches, notes=_notes)
