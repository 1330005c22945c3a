"""keras-hub causal LM backbones get ``get_layout_map(mesh)`` where they have none.

keras-hub's ``Backbone`` base class gets a ``get_layout_map`` classmethod
(:func:`keras_dtensor_fix.hub.layouts.get_layout_map`): a backbone with a row
in ``hub.layouts.ROWS`` (or a subclass of one) returns its layout, any other
the planner's (``hub/probe``), or an error saying what to write. Backbones
with their own (Gemma, Llama, Qwen, the MoEs) keep theirs. An
``added`` patch: deactivation deletes it, and a keras-hub whose base class
has one keeps its own.
"""

from __future__ import annotations

import types

from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.hub import layouts


def patches(module: types.ModuleType) -> list[Patch]:
    if not isinstance(getattr(module, "Backbone", None), type):
        raise LookupError("Backbone")
    # layouts.get_layout_map takes the class first: it is the classmethod
    method = classmethod(layouts.get_layout_map)
    return [Patch(module.__name__, "Backbone.get_layout_map", method, added=True)]


def _notes() -> list[str]:
    names = ", ".join(cls_name for _, cls_name in layouts.ROWS)
    return [f"get_layout_map(mesh) for keras-hub's {names}"]


IMPLEMENTATION = Implementation(patches, notes=_notes)
