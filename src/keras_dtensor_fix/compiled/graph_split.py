"""A functional model's graph split after its last repeated block.

:mod:`keras_dtensor_fix.compiled.tail` runs the nodes up to the last one
holding a block eagerly and the rest in a compiled region. Here: which nodes
those are, and how they run as ``Function._run_through_graph`` runs them.

Where that last node calls a nested functional model (a keras-hub causal LM's
backbone, holding the blocks and then its final norm), the split goes inside
it: the nested model is *opened* (:class:`Opened`). Its nodes up to its last
block run eagerly, as its own call would run them (its inputs standardized,
its name scope open), and its nodes after the last block run in the region
before the outer model's. Only where its call adds nothing to its graph's:
Keras's own ``Layer.__call__``, ``Functional.call`` and ``_run_through_graph``,
no autocast scope of its own, no activity regularizer, no output layout; a
call with a mask, or any other argument, runs it whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.ops.values import output_laid_out

__all__ = [
    "Opened",
    "boundary",
    "close_opened",
    "holding",
    "nodes_of",
    "open_nested",
    "pack",
    "refusal",
    "run_nodes",
    "run_opened",
]


@dataclass
class Opened:
    """A nested functional model whose call holds the last block, split."""

    #: The nested model.
    model: Any
    #: The outer node calling it.
    node: Any
    #: Its nodes up to its last block (run eagerly) and after (the region).
    front: list[Any]
    tail: list[Any]


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


def open_nested(node: Any, ids: set[int]) -> Opened | None:
    """``node``'s nested functional model, split after its last block, where
    its call adds nothing to its graph's (the module); else None."""
    inner = node.operation
    functional = targets.keras_object("Functional")
    function = targets.keras_object("Function")
    keras_own = (
        ("__call__", targets.keras_object("Layer")),
        ("call", functional),
        ("_run_through_graph", function),
        ("_standardize_inputs", functional),
    )
    cls = type(inner)
    if (
        not isinstance(inner, functional)
        or any(
            getattr(cls, name) is not getattr(owner, name) for name, owner in keras_own
        )
        or getattr(inner, "activity_regularizer", None) is not None
        or getattr(inner, "_nnx_op_mapping", None)
        or inner.compute_dtype != inner.variable_dtype
    ):
        return None
    nodes = nodes_of(inner)
    found = holding(nodes, ids)
    if not found or found[-1] == len(nodes) - 1:
        return None
    return Opened(inner, node, nodes[: found[-1] + 1], nodes[found[-1] + 1 :])


def run_opened(opened: Opened, values: dict[int, Any]) -> dict[int, Any] | None:
    """Run ``opened``'s front as its call would, from the outer ``values``.

    Returns its values, or None where this call must run it whole (a mask,
    another argument, an autocast scope open).
    """
    args, kwargs = opened.node.arguments.fill_in(values)
    kwargs = {k: v for k, v in kwargs.items() if k != "training"}
    tree = targets.keras_object("tree")
    inner = opened.model
    if len(args) != 1 or kwargs or targets.keras_object("get_autocast_scope")():
        return None
    if any(getattr(v, "_keras_mask", None) is not None for v in tree.flatten(args)):
        return None
    with inner._open_name_scope():
        flat = inner._standardize_inputs(args[0])
        if inner._convert_input_args:  # as its call converts them
            policy = inner.dtype_policy
            flat = [
                policy.convert_input(v, inner.autocast, inner.input_dtype) for v in flat
            ]
        inner_values = {id(ref): v for ref, v in zip(inner.inputs, flat, strict=True)}
        run_nodes(inner, opened.front, inner_values)
    return inner_values


def close_opened(opened: Opened, inner_values: dict, values: dict) -> None:
    """Run ``opened``'s tail into ``inner_values``; its outputs into ``values``
    as the outer node's."""
    run_nodes(opened.model, opened.tail, inner_values)
    outputs = [inner_values[id(ref)] for ref in opened.model.outputs]
    for ref, value in zip(opened.node.outputs, outputs, strict=True):
        values[id(ref)] = value


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


def boundary(nodes: list[Any], outputs: list[Any], made: list[Any] = ()) -> list[Any]:
    """What ``nodes`` read and ``outputs`` need that neither ``nodes`` nor
    ``made`` make: the tensors a region takes in, in order, each once."""
    wanted = [ref for node in nodes for ref in node.input_tensors] + list(outputs)
    skip = {id(ref) for node in nodes for ref in node.outputs}
    skip.update(id(ref) for ref in made)
    found = []
    for ref in wanted:
        if id(ref) not in skip:
            skip.add(id(ref))
            found.append(ref)
    return found


def refusal(model: Any, opened: Any, nodes: list[Any]) -> str | None:
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
    paths = ["/output"]
    if opened is not None:
        if output_laid_out(opened.model):
            return f"the LayoutMap lays out {opened.model.path}/output"
        # its tail's layers' paths inside its call
        name = opened.model.name
        for node in opened.tail:
            paths.append(f"{model.name}/{name}/{node.operation.name}/output")
    for path in paths:
        if distribution is not None and distribution.get_tensor_layout(path):
            return f"the LayoutMap lays out the path '{path}'"
    return None
