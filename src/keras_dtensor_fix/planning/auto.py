"""``auto_layout_map``: trace, choose, cost, and write the rules; its :class:`Plan`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from keras_dtensor_fix.planning.choose import Choice, choose
from keras_dtensor_fix.planning.cost import Cost, evaluate
from keras_dtensor_fix.planning.trace import Traced, trace_model

__all__ = ["Plan", "auto_layout_map"]


@dataclass
class Plan:
    """What the planner saw and chose, and what it costs."""

    traced: Traced
    choices: dict[str, Choice]
    cost: Cost
    mesh: dict[str, int]

    def summary(self) -> str:
        """One line: what was split how, and the bytes per rank."""
        roles = Counter(c.role for c in self.choices.values() if c.role != "replicated")
        said = ", ".join(f"{n} {role}" for role, n in roles.items()) or "nothing split"
        return (
            f"planned {len(self.choices)} weights on mesh {self.mesh}: {said}; "
            f"{self.cost.ratio:.2f}x one process's weight bytes per rank, "
            f"{self.cost.count} collectives per step"
        )


def auto_layout_map(
    build: Callable[[], Any],
    mesh: Any,
    sample_input: Any = None,
    *,
    model_axis: str = "model",
    batch_axis: str = "batch",
) -> Any:
    """A ``keras.distribution.LayoutMap`` planned from the model ``build()`` returns.

    Megatron's tensor parallelism read off one forward traced on ``meta``
    (column then row, heads, large tables by rows; the batch axis splits the
    hidden axis). ``sample_input``: one batch, for a model without ``Input``
    shapes. Print the map for its rules; ``.plan`` holds the choices and cost.
    See docs/planner.md.
    """
    import keras

    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            f"mesh must be a keras.distribution.DeviceMesh, got {type(mesh).__name__}"
        )
    sizes = dict(zip(mesh.axis_names, mesh.shape, strict=True))
    if model_axis not in sizes:
        raise ValueError(
            f"{model_axis!r} is not an axis of the mesh (its axes: "
            f"{list(mesh.axis_names)}); pass model_axis= naming the one to split "
            "weights on"
        )
    traced = trace_model(build, sample_input)
    choices = choose(
        traced.flow, traced.shapes, traced.nbytes, sizes, model_axis, batch_axis
    )
    assignment = {path: choice.axes for path, choice in choices.items()}
    cost = evaluate(
        traced.flow, traced.nbytes, assignment, sizes, model_axis, batch_axis
    )
    from keras_dtensor_fix.planning.layout_map import PlannedLayoutMap, rules

    layout_map = PlannedLayoutMap(mesh, Plan(traced, choices, cost, sizes))
    layout_map.update(rules(assignment, traced.shapes))
    return layout_map
