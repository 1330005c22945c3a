"""A functional model's graph split after its last repeated block.

:mod:`keras_dtensor_fix.compiled.tail` runs the nodes up to the last one
holding a block eagerly and the rest in a compiled region. Here: which nodes
those are, and how they run as ``Function._run_through_graph`` runs them.
"""

from __future__ import annotations

from typing import Any

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.ops.values import output_laid_out

__all__ = ["boundary", "holding", "nodes_of", "pack", "refusal", "run_nodes"]


def nodes_of(model: Any) -> list[Any]:
    """``model``'s operation nodes in the order Keras runs them."""
    return [
        node
        for depth in sorted(model._nodes_by_depth, reverse=True)
        for node in model._nodes_by_depth[depth]
        if node.operation is not None and not node.is_input
    ]


def holding(nodes: list[Any], ids: set[int]) -> list[int]:
    """The positions of the nodes whose operation is or holds a routed block."""
    return [i for i, node in enumerate(nodes) if _holds(node.operation, ids)]


def _holds(operation: Any, ids: set[int]) -> bool:
    if id(operation) in ids:
        return True
    layers = getattr(operation, "_flatten_layers", None)
    if layers is None:
        return False
    return any(id(layer) in ids for layer in layers(include_self=False, recursive=True))


def run_nodes(model: Any, nodes: list[Any], values: dict[int, Any]) -> None:
    """Run ``nodes`` as ``Function._run_through_graph`` does, into ``values``."""
    tree = targets.keras_object("tree")
    operation_for = getattr(model, "_get_operation_for_node", None)
    for node in nodes:
        if any(id(ref) not in values for ref in node.input_tensors):
            continue  # not computable: Keras skips it too
        args, kwargs = node.arguments.fill_in(values)
        operation = operation_for(node) if operation_for else node.operation
        outputs = operation(*args, **kwargs)
        for ref, value in zip(node.outputs, tree.flatten(outputs), strict=False):
            values[id(ref)] = value


def pack(model: Any, values: dict[int, Any]) -> Any:
    """``model``'s outputs from ``values``, in its output structure."""
    tree = targets.keras_object("tree")
    found = [values[id(ref)] for ref in model.outputs]
    return tree.pack_sequence_as(model._outputs_struct, found)


def boundary(nodes: list[Any], outputs: list[Any]) -> list[Any]:
    """What ``nodes`` read and ``outputs`` need that ``nodes`` do not make:
    the tensors a region takes in, in order, each once."""
    wanted = [ref for node in nodes for ref in node.input_tensors] + list(outputs)
    skip = {id(ref) for node in nodes for ref in node.outputs}
    found = []
    for ref in wanted:
        if id(ref) not in skip:
            skip.add(id(ref))
            found.append(ref)
    return found


def refusal(nodes: list[Any]) -> str | None:
    """Why the region cannot hold ``nodes``: an output layout (which Keras
    applies in a layer's call) or an activity regularizer; else None."""
    distribution = targets.keras_object("distribution")()
    for node in nodes:
        layers = getattr(node.operation, "_flatten_layers", None)
        for layer in layers(include_self=True, recursive=True) if layers else ():
            if output_laid_out(layer):
                return f"the LayoutMap lays out {layer.path}/output"
            if getattr(layer, "activity_regularizer", None) is not None:
                return f"{layer.name} has an activity regularizer"
    if distribution is not None and distribution.get_tensor_layout("/output"):
        return "the LayoutMap lays out the path '/output'"
    return None
