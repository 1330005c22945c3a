"""keras-hub causal LM backbones get ``get_layout_map(mesh)`` where they have none.

``Backbone.get_layout_map`` (:func:`keras_dtensor_fix.hub.layouts.get_layout_map`):
a backbone with a row in ``hub.layouts.ROWS`` returns its layout, any other
the planner's, or an error saying what to write. An ``added`` patch: backbones
with their own keep theirs.
"""

from __future__ import annotations

import types

from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.hub import layouts


def patches(module: types.ModuleType) -> list[Patch]:
    if not isinstance(getattr(module, "Backbone", None), type):
        raise LookupError("Backbone")
    method = classmethod(layouts.get_layout_map)
    return [Patch(module.__name__, "Backbone.get_layout_map", method, added=True)]


def _notes() -> list[str]:
    names = ", ".join(cls_name for _, cls_name in layouts.ROWS)
    return [f"get_layout_map(mesh) for keras-hub's {names}"]


IMPLEMENTATION = Implementation(patches, notes=_notes)
