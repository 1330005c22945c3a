"""The layers after a model's last repeated block and the loss, one compiled region.

In blocks mode they would run eagerly on DTensors (the logits' redistribution, the
log-softmax and its backward) where a whole step fuses them. The region crosses the
model's call, so while Keras's ``train_step`` runs (:func:`step` keeps its batch) a
functional model gets three instance attributes: ``_run_through_graph`` runs the nodes
up to the last one holding a block eagerly, then the rest, the loss and the built
compiled metrics' update in the region; ``_compute_loss`` returns the region's loss;
``compute_metrics`` only collects the results. The outputs pass
:func:`~keras_dtensor_fix.dtensor.zero_gradients_if_unused`: a loss Keras computes
itself from the model's output still has its gradient."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.utils._pytree as pytree

from keras_dtensor_fix.compiled import refusals, region
from keras_dtensor_fix.dtensor import (
    DTensor,
    forget_kept,
    keep,
    kept_detached,
    reducing_input,
    without_kept,
    zero_gradients_if_unused,
)
from keras_dtensor_fix.engine import state, targets

#: The instance attributes this module sets (undone by :func:`uninstall`).
_ATTRIBUTES = ("_run_through_graph", "_compute_loss", "compute_metrics")
_ABSENT = object()
#: The arguments of ``_compute_loss`` that are a step's own (:class:`_Pending`'s).
_BATCH = ("x", "y", "y_pred", "sample_weight")


@dataclass
class _Plan:
    """How one model's graph splits: eager front, compiled tail."""

    front: list[Any]
    tail: list[Any]
    #: The tensors the tail reads from the front (outputs passed through too).
    boundary: list[Any]
    #: Whether the loss reads ``x`` (a ``compute_loss`` of the model's own).
    reads_x: bool
    region: Any
    #: The instance's own values of :data:`_ATTRIBUTES` before (:func:`uninstall`).
    saved: dict[str, Any] = field(default_factory=dict)
    #: The batch of the model's ``train_step`` running now (:func:`step`).
    pending: Any = None


@dataclass
class _Pending:
    """One running ``train_step``'s batch and, once the tail ran, its results."""

    x: Any
    y: Any
    sample_weight: Any
    called: bool = False
    y_pred: Any = None
    loss: Any = field(default=None, repr=False)
    #: Whether the region updated the compiled metrics with ``y_pred``.
    metrics: bool = False


def refusal(model: Any) -> str | None:
    """Why ``model``'s tail cannot be a region, or None."""
    functional = targets.keras_object("Functional")
    function = targets.keras_object("Function")
    base = targets.keras_object("BaseTrainer")
    cls = type(model)
    if not isinstance(model, functional):
        return "it is not a functional model"
    if getattr(cls, "call", None) is not functional.call:
        return "its class has a call() of its own"
    if getattr(cls, "_run_through_graph", None) is not function._run_through_graph:
        return "its class runs its graph its own way"
    if not refusals.keras_train_step(model):
        return "its class has a train_step() of its own"
    if getattr(cls, "_compute_loss", None) is not base._compute_loss:
        return "its class has a _compute_loss() of its own"
    if getattr(model, "_nnx_op_mapping", None):
        return "its operations are mapped"
    if getattr(model, "activity_regularizer", None) is not None:
        return "it has an activity regularizer"
    return None


def plan(model: Any, routed: list[Any]) -> _Plan | str:
    """Split ``model``'s graph after its last node holding a routed block; the plan, or
    why there is none."""
    reason = refusal(model)
    if reason is not None:
        return reason
    for name in ("tree", "unpack_singleton"):
        targets.keras_object(name)  # imported now: the region's trace cannot
    ids = {id(block) for block in routed}
    nodes = [
        node
        for depth in sorted(model._nodes_by_depth, reverse=True)
        for node in model._nodes_by_depth[depth]
        if node.operation is not None and not node.is_input
    ]
    held = [i for i, node in enumerate(nodes) if _holds(node.operation, ids)]
    last = held[-1] if held else len(nodes) - 1
    if last == len(nodes) - 1:
        return "no layer follows its last block"
    front, tail = nodes[: last + 1], nodes[last + 1 :]
    reason = refusals.layers(
        layer
        for node in tail
        if hasattr(node.operation, "_flatten_layers")
        for layer in node.operation._flatten_layers(include_self=True, recursive=True)
    )
    if reason is not None:
        return reason
    boundary = _boundary(tail, model.outputs)
    base = targets.keras_object("BaseTrainer")
    reads_x = getattr(type(model), "compute_loss", None) is not base.compute_loss
    compiled = region.Region(
        _tail,
        f"the layers after {model.name}'s last block and its loss",
        qualname=f"{model.name}.tail",
        then="they run eagerly from now on.",
    )
    return _Plan(front, tail, boundary, reads_x, compiled)


def install(model: Any, routed: list[Any]) -> _Plan | str:
    """Run ``model``'s tail and loss as one region in its training steps; the plan, else
    why not."""
    found = plan(model, routed)
    if isinstance(found, str):
        return found
    original_run = model._run_through_graph
    original_loss = model._compute_loss
    original_metrics = model.compute_metrics

    def run_through_graph(inputs: Any, *args: Any, **kwargs: Any) -> Any:
        pending = found.pending
        if (
            pending is None
            or pending.called
            or args
            or kwargs
            or found.region.failed
            or not region.eligible()
        ):
            return original_run(inputs, *args, **kwargs)
        pending.called = True
        return _run(model, found, inputs, pending)

    def compute_loss(*args: Any, **kwargs: Any) -> Any:
        pending = found.pending
        if (
            pending is not None
            and pending.loss is not None
            and not args
            and all(kwargs.get(k) is getattr(pending, k) for k in _BATCH)
            and kwargs.get("training", True)
        ):
            loss, pending.loss = pending.loss, None
            return loss
        if pending is not None and pending.y_pred is not None:
            # a loss of its own may differentiate y_pred: no detached gather
            pytree.tree_map(forget_kept, pending.y_pred)
        return original_loss(*args, **kwargs)

    def compute_metrics(x: Any, y: Any, y_pred: Any, sample_weight: Any = None) -> Any:
        pending = found.pending
        if (
            pending is not None
            and pending.metrics
            and y_pred is pending.y_pred
            and y is pending.y
            and sample_weight is pending.sample_weight
        ):
            pending.metrics = False
            return model.get_metrics_result()
        return original_metrics(x, y, y_pred, sample_weight=sample_weight)

    found.saved = {name: vars(model).get(name, _ABSENT) for name in _ATTRIBUTES}
    ours = (run_through_graph, compute_loss, compute_metrics)
    for name, value in zip(_ATTRIBUTES, ours, strict=True):
        state.set_attribute(model, name, value)
    return found


def step(found: _Plan, train_step: Callable[..., Any], args: tuple, kwargs: dict):
    """Keras's ``train_step``, its batch kept for the model's tail while it runs."""
    if len(args) != 1 or kwargs:
        return train_step(*args, **kwargs)
    found.pending = _Pending(*targets.keras_object("unpack_x_y_sample_weight")(args[0]))
    try:
        return train_step(*args, **kwargs)
    finally:
        found.pending = None


def uninstall(model: Any, found: _Plan) -> None:
    """Take the attributes :func:`install` set off ``model``."""
    for name, before in found.saved.items():
        # Whatever wraps ours now (the compile family's _compute_loss wrapper,
        # made again at the next build) goes with it.
        if before is _ABSENT:
            vars(model).pop(name, None)
        else:
            vars(model)[name] = before


def _run(model: Any, found: _Plan, inputs: Any, pending: _Pending) -> Any:
    flat = targets.keras_object("tree").flatten(inputs)
    values = {id(ref): value for ref, value in zip(model.inputs, flat, strict=False)}
    _run_nodes(model, found.front, values)
    boundary = [values.get(id(ref)) for ref in found.boundary]
    if any(v is None or getattr(v, "_keras_mask", None) is not None for v in boundary):
        return _rest(model, found.tail, values)  # a mask rides on its tensor
    x = pending.x if found.reads_x else None
    metrics = _metrics_in_region(model)
    arguments = (model, found, boundary, x, pending.y, pending.sample_weight, metrics)
    found.region.what = (
        f"the layers after {model.name}'s last block and its loss"
        f"{' and metrics' if metrics else ''}"
    )
    with region.scopeless():
        result = found.region(lambda: None, *arguments)
    if result is None:
        return _rest(model, found.tail, values)
    (outputs, loss), kept = result
    leaves, spec = pytree.tree_flatten((outputs, loss))
    leaves = zero_gradients_if_unused(leaves)
    for leaf, entries in zip(leaves, kept, strict=True):
        keep(leaf, entries)  # the loss's gathered logits, for the metrics
    outputs, pending.loss = pytree.tree_unflatten(leaves, spec)
    pending.y_pred = targets.keras_object("unpack_singleton")(outputs)
    pending.metrics = metrics
    return outputs


def _metrics_in_region(model: Any) -> bool:
    """Whether the region updates the compiled metrics: Keras's own ``compute_metrics``,
    its metrics built (none is made in a graph)."""
    base = targets.keras_object("BaseTrainer")
    return (
        getattr(getattr(model, "_compile_metrics", None), "built", False)
        and getattr(type(model), "compute_metrics", None) is base.compute_metrics
    )


def _tail(model, found, boundary, x, y, weight, metrics):
    """The region: the tail's nodes, the loss and, where ``metrics``, the compiled
    metrics' update."""
    # Megatron's "f" of each input as the graph's first op (as a block's).
    boundary = [reducing_input(value) for value in boundary]
    values = {id(ref): v for ref, v in zip(found.boundary, boundary, strict=True)}
    outputs = _rest(model, found.tail, values)
    y_pred = targets.keras_object("unpack_singleton")(outputs)
    compute = type(model)._compute_loss
    loss = compute(model, x=x, y=y, y_pred=y_pred, sample_weight=weight, training=True)
    if metrics:
        model._compile_metrics.update_state(y, y_pred, weight)
    leaves, spec = pytree.tree_flatten((outputs, loss))
    kept = [kept_detached(v) if isinstance(v, DTensor) else [] for v in leaves]
    return pytree.tree_unflatten([without_kept(v) for v in leaves], spec), kept


def _holds(operation: Any, ids: set[int]) -> bool:
    layers = getattr(operation, "_flatten_layers", None)
    inner = layers(include_self=False, recursive=True) if layers else ()
    return id(operation) in ids or any(id(layer) in ids for layer in inner)


def _run_nodes(model: Any, nodes: list[Any], values: dict[int, Any]) -> None:
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


def _rest(model: Any, nodes: list[Any], values: dict[int, Any]) -> Any:
    """Run ``nodes`` into ``values``; the model's outputs."""
    _run_nodes(model, nodes, values)
    found = [values[id(ref)] for ref in model.outputs]
    return targets.keras_object("tree").pack_sequence_as(model._outputs_struct, found)


def _boundary(nodes: list[Any], outputs: list[Any]) -> list[Any]:
    """The tensors ``nodes`` read and ``outputs`` need that ``nodes`` do not make."""
    wanted = [ref for node in nodes for ref in node.input_tensors] + list(outputs)
    made = {id(ref) for node in nodes for ref in node.outputs}
    return list({id(ref): ref for ref in wanted if id(ref) not in made}.values())
