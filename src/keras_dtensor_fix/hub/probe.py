"""A keras-hub backbone class's layout, planned on a tiny probe of it.

``get_layout_map(mesh)`` knows the class, not the config: the planner
(``keras_dtensor_fix.auto_layout_map``) plans on an instance of the class's
defaults and small sizes for its required arguments (:data:`SIZES`, each
dividing by the mesh's axes); its rules read every layer number as ``\\d+``,
so they name the same weights of any config. A class whose required
arguments the probe cannot size gets none.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

__all__ = ["SIZES", "planned_layout_map"]

_LOG = logging.getLogger("keras_dtensor_fix.hub")

#: Required argument -> its size, in units of (model axis size x batch axis
#: size), of the model axis size (heads), or as it is ("int", "value").
SIZES: dict[str, tuple[str, Any]] = {
    "image_shape": ("value", (16, 16, 3)),
    "patch_size": ("int", 4),
    "mlp_dim": ("unit", 32),
    "vocabulary_size": ("unit", 64),
    "hidden_dim": ("unit", 16),
    "intermediate_dim": ("unit", 32),
    "num_layers": ("int", 2),
    "num_heads": ("model", 1),
    "num_query_heads": ("model", 1),
    "num_key_value_heads": ("model", 1),
    "num_attention_heads": ("model", 1),
    "head_dim": ("int", 8),
    "key_value_dim": ("int", 8),
    "max_sequence_length": ("int", 16),
}


def probe_config(cls: type, model: int, batch: int) -> dict[str, Any] | None:
    """Arguments for a tiny ``cls``, or None where one is not known."""
    scale = {"unit": model * batch, "model": max(model, 2), "int": 1}
    config: dict[str, Any] = {}
    for name, param in inspect.signature(cls.__init__).parameters.items():
        if name == "dropout":
            config[name] = 0.0
        elif name == "self" or param.kind in (param.VAR_KEYWORD, param.VAR_POSITIONAL):
            continue
        elif param.default is not param.empty:
            continue
        elif name not in SIZES:
            return None
        else:
            unit, size = SIZES[name]
            config[name] = size if unit == "value" else size * scale[unit]
    return config


def planned_layout_map(cls: type, mesh: Any, model_axis: str, batch_axis: str) -> Any:
    """The planner's LayoutMap for ``cls``, logged once; None without a probe."""
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    config = probe_config(cls, sizes[model_axis], sizes.get(batch_axis, 1))
    if config is None:
        return None
    import keras_dtensor_fix

    layout_map = keras_dtensor_fix.auto_layout_map(
        lambda: cls(**config), mesh, model_axis=model_axis, batch_axis=batch_axis
    )
    _LOG.info(
        "keras-dtensor-fix: %s has no layout of its own; planned one from its "
        "structure (%s; print the map for its rules)",
        cls.__qualname__,
        layout_map.plan.summary(),
    )
    return layout_map
