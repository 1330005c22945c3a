"""What a layout costs a train step: bytes per rank and collectives, estimated.

Pure arithmetic over a :class:`~keras_dtensor_fix.planning.dataflow.Dataflow`
and any assignment (weight -> mesh axis or None per weight axis), so that two
layouts compare on one scale; the table of collectives is docs/planner.md's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

from keras_dtensor_fix.planning.dataflow import Dataflow

__all__ = ["Cost", "evaluate"]

Assignment = dict[str, tuple[str | None, ...]]


@dataclass
class Cost:
    """A layout's weight bytes per rank (by weight) and collectives per step."""

    per_rank: dict[str, int] = field(default_factory=dict)
    bytes_one_process: int = 0
    collectives: dict[str, list[tuple[str, int]]] = field(default_factory=dict)

    @property
    def bytes_per_rank(self) -> int:
        return sum(self.per_rank.values())

    @property
    def ratio(self) -> float:
        """Bytes per rank in units of one process's weight bytes."""
        return self.bytes_per_rank / max(self.bytes_one_process, 1)

    @property
    def count(self) -> int:
        return sum(len(c) for c in self.collectives.values())

    @property
    def moved(self) -> int:
        return sum(b for c in self.collectives.values() for _, b in c)

    def add(self, weight: str, what: str, nbytes: int) -> None:
        self.collectives.setdefault(weight, []).append((what, nbytes))


def evaluate(
    flow: Dataflow,
    nbytes: dict[str, int],
    assignment: Assignment,
    mesh: dict[str, int],
    model_axis: str = "model",
    batch_axis: str = "batch",
    itemsize: int = 4,
) -> Cost:
    """The :class:`Cost` of ``assignment`` (weights it leaves out: replicated)."""
    cost = Cost(bytes_one_process=sum(nbytes.values()))
    for name, size in nbytes.items():
        axes = assignment.get(name, ())
        per_rank = cost.per_rank[name] = size // prod(mesh.get(a, 1) for a in axes if a)
        if mesh.get(batch_axis, 1) > 1:
            if batch_axis in axes:
                cost.add(name, f"all-gather over {batch_axis}", per_rank)
                cost.add(name, f"reduce-scatter over {batch_axis}", per_rank)
            else:
                cost.add(name, f"gradient all-reduce over {batch_axis}", per_rank)
    if mesh.get(model_axis, 1) > 1:
        _model_axis(flow, assignment, model_axis, itemsize, cost)
    return cost


def _role(product, axes: tuple, model_axis: str) -> str | None:
    """How a product reads its weight split on the model axis (None: whole)."""
    if model_axis not in axes:
        return None
    axis = axes.index(model_axis)
    if product.kind == "conv":
        return "conv"
    if axis in product.contracted:
        return "indexed" if product.kind == "lookup" else "row"
    return "column" if axis in product.output else None


def _model_axis(flow, assignment, model_axis, itemsize, cost) -> None:
    roles = {
        p.index: _role(p, assignment.get(p.weight, ()), model_axis)
        for p in flow.products
    }
    consumers = flow.consumers()
    seen_inputs: set[tuple] = set()
    for p in flow.products:
        role, add = roles[p.index], cost.add
        feeders = {roles[a] for a in p.inputs}
        readers = {roles[c] for c in consumers[p.index]}
        inward, outward = p.in_numel * itemsize, p.out_numel * itemsize
        if role == "row":
            add(p.weight, "all-reduce of its output", outward)
            if feeders != {"column"}:
                add(p.weight, "all-gather of its input's gradient", inward)
        elif role == "column":
            key = (p.inputs, p.in_numel)
            if feeders != {"column"} and key not in seen_inputs:
                seen_inputs.add(key)
                add(p.weight, "all-reduce of its input's gradient", inward)
            if readers != {"row"}:
                add(p.weight, "all-gather of its output", outward)
        elif role == "indexed":
            add(p.weight, "all-reduce of the rows looked up", outward)
        elif role == "conv":
            add(p.weight, "all-gather of the kernel", 0)
