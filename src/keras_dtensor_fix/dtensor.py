"""Pure-torch DTensor helpers: find a DTensor among arguments, promote plain tensors.

Nothing here knows Keras. A plain tensor is promoted only as the *full logical
value* (a Replicate DTensor on the partner's mesh); a tensor that looks like one
rank's shard of the partner is refused with :class:`PromotionError`.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = [
    "DTensor",
    "PromotionError",
    "all_reduce_sum",
    "all_reduce_sums",
    "batch_parallel_call",
    "update_in_place_of",
    "vocab_parallel_lookup",
    "describe",
    "find_dtensor",
    "gather_axes_splitting",
    "gather_non_batch_axes",
    "has_plain_tensor",
    "implicit_replication",
    "is_replicated",
    "local_shard_dim",
    "promote",
    "promote_args",
    "replicate",
    "replicated_locals",
    "same_mesh",
    "settle",
    "replicate_result",
    "set_implicit_replication",
    "to_placements",
    "unwrap_local",
    "wrap_local",
]


class PromotionError(RuntimeError):
    """A plain tensor met a DTensor and could not be promoted safely.

    ``problem`` says what was found, ``hint`` what to do; the message is both.
    """

    def __init__(self, problem: str, hint: str = "") -> None:
        super().__init__(f"{problem} {hint}".strip())
        self.problem = problem
        self.hint = hint


def implicit_replication() -> bool:
    """Whether DTensor treats a plain tensor operand as a replicated value here.

    torch keeps the switch per thread (C++ thread-local state, carried into
    autograd's backward threads).
    """
    return bool(DTensor._op_dispatcher._allow_implicit_replication)


def set_implicit_replication(on: bool) -> None:
    """Turn DTensor's implicit replication of plain tensors on or off (this thread).

    It lives in DTensor's dispatcher, in C: an op that mixes a plain tensor
    with a DTensor costs no Python beyond DTensor's own dispatch, and an op
    without a DTensor is not touched at all.
    """
    DTensor._op_dispatcher._allow_implicit_replication = bool(on)


def _is_plain(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and not isinstance(value, DTensor)


def find_dtensor(values: Iterable[Any]) -> DTensor | None:
    """Return the first DTensor in ``values`` or one level inside a list/tuple."""
    for value in values:
        if isinstance(value, DTensor):
            return value
        if isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, DTensor):
                    return item
    return None


def has_plain_tensor(values: Iterable[Any]) -> bool:
    """Whether ``values`` (or lists inside) hold a non-scalar plain tensor."""
    for value in values:
        if _is_plain(value) and value.ndim:
            return True
        if isinstance(value, (list, tuple)):
            for item in value:
                if _is_plain(item) and item.ndim:
                    return True
    return False


def describe(value: Any) -> str:
    """A short description of a tensor for error messages: shape, dtype, placements."""
    if isinstance(value, DTensor):
        placements = ", ".join(str(p) for p in value.placements)
        local = tuple(value._local_tensor.shape)
        return (
            f"DTensor(shape={tuple(value.shape)}, local={local}, "
            f"dtype={value.dtype}, placements=({placements}))"
        )
    if isinstance(value, torch.Tensor):
        return f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype})"
    return type(value).__name__


def wrap_local(value: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> DTensor:
    """``DTensor.from_local(value, mesh, placements, run_check=False)``, cheaper.

    The DTensor is built as ``from_local`` builds it, from a cached spec. A
    tensor that needs no gradient (a batch, a metric input) skips the autograd
    op; one that does takes :class:`_WrapLocal`, a smaller one. A Partial
    value that needs a gradient, a negative shard dim, a traced step and any
    torch without those internals go through ``from_local``.
    """
    if value.device.type != mesh.device_type:
        value = value.to(mesh.device_type)
    placements = tuple(placements)
    grad = value.requires_grad and torch.is_grad_enabled()
    if (
        _SPEC is None
        or torch.compiler.is_compiling()
        or any(isinstance(p, Shard) and p.dim < 0 for p in placements)
        or (grad and any(p.is_partial() for p in placements))
    ):
        return DTensor.from_local(value, mesh, placements, run_check=False)
    key = (mesh, placements, value.shape, value.stride(), value.dtype)
    spec = _SPECS.get(key)
    if spec is None:
        _, meta_class, global_info = _SPEC
        shape, stride = global_info(value, mesh, placements)
        meta = meta_class(torch.Size(shape), tuple(stride), value.dtype)
        spec = _remember(key, _spec(mesh, placements, meta))
    if grad:
        return _WrapLocal.apply(value, spec)
    return DTensor(value.view_as(value), _copy(spec), requires_grad=False)


class _WrapLocal(torch.autograd.Function):
    """``from_local``'s autograd op for Replicate and Shard placements.

    The gradient goes back as the local tensor of a gradient with the forward
    placements (redistributed to them first if it has others).
    """

    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, spec: Any) -> DTensor:
        ctx.spec = spec
        # As from_local: the wrapper's requires_grad follows the local tensor's.
        return DTensor(
            value.view_as(value), _copy(spec), requires_grad=value.requires_grad
        )

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if isinstance(grad, DTensor):
            grad = settle(grad, ctx.spec.placements)._local_tensor
        return grad, None


def unwrap_local(
    value: DTensor, grad_placements: Sequence[Any] | None = None
) -> torch.Tensor:
    """``value.to_local(grad_placements=...)``, cheaper when it needs a gradient.

    The gradient comes back as :func:`wrap_local` of the plain gradient with
    ``grad_placements`` (default: the forward placements), from a cached spec,
    where ``to_local``'s backward builds a new one. A Partial ``value``, a
    traced step and any torch without those internals go through ``to_local``.
    """
    if not (value.requires_grad and torch.is_grad_enabled()):
        return value._local_tensor.view_as(value._local_tensor)
    if (
        _SPEC is None
        or torch.compiler.is_compiling()
        or any(p.is_partial() for p in value.placements)
    ):
        return value.to_local(grad_placements=grad_placements)
    placements = tuple(grad_placements or value.placements)
    return _UnwrapLocal.apply(value, placements)


def reducing_gradient(value: Any) -> Any:
    """``value``, whose gradient is summed over its Partial mesh axes once.

    Megatron's "f" operator. A replicated activation read by column-parallel
    products (Q, K and V, an FFN's gates, a vocabulary-sharded head) gets a
    Partial gradient from each; autograd adds those up (no communication) and
    this op's backward all-reduces the total once. Handed on as Partial, the
    gradient ran through the ops before as Partial: a replicated weight there
    (a norm's scale) got a Partial gradient, and every later reader of the
    residual stream reduced its own copy. One op per DTensor (cached on it: its
    readers share the reduction). Traced, the op is ``redistribute`` to the
    same placements: identity forward, and a backward that reduces a Partial
    gradient to the input's placements. Leaves (weights), values that need no
    gradient and a torch without the spec internals pass as is.
    """
    if (
        not isinstance(value, DTensor)
        or value.is_leaf  # dynamo reads no grad_fn; an activation is no leaf
        or not value.requires_grad
        or not torch.is_grad_enabled()
        or _SPEC is None
        or any(p.is_partial() for p in value.placements)
    ):
        return value
    reducing = getattr(value, _REDUCING, None)
    if reducing is None:
        if torch.compiler.is_compiling():
            reducing = value.redistribute(value.device_mesh, value.placements)
        else:
            reducing = _ReduceGradient.apply(value)
        setattr(value, _REDUCING, reducing)
    return reducing


#: The attribute :func:`reducing_gradient` keeps an activation's op in.
_REDUCING = "_keras_dtensor_fix_reducing"


class _ReduceGradient(torch.autograd.Function):
    """Identity forward; the gradient's Partial axes summed in backward."""

    @staticmethod
    def forward(ctx: Any, value: DTensor) -> DTensor:
        ctx.mesh = value.device_mesh
        local = value._local_tensor
        return DTensor(local.view_as(local), _copy(value._spec), requires_grad=True)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> Any:
        if not isinstance(grad, DTensor):
            return grad
        placements = tuple(grad.placements)
        axes = [i for i, p in enumerate(placements) if p.is_partial()]
        if not axes:
            return grad
        total = _all_reduce(grad._local_tensor, ctx.mesh, axes)
        settled = tuple(Replicate() if p.is_partial() else p for p in placements)
        return wrap_local(total, ctx.mesh, settled)


class _UnwrapLocal(torch.autograd.Function):
    """``to_local``'s autograd op for Replicate and Shard placements."""

    @staticmethod
    def forward(ctx: Any, value: DTensor, placements: tuple) -> torch.Tensor:
        ctx.mesh, ctx.placements = value.device_mesh, placements
        ctx.set_materialize_grads(False)
        local = value._local_tensor
        # A fresh tensor: autograd writes its metadata into the result.
        return local.view_as(local)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if grad is not None and not isinstance(grad, DTensor):
            grad = wrap_local(grad, ctx.mesh, ctx.placements)
        return grad, None


def all_reduce_sum(value: torch.Tensor, mesh: Any, axes: Sequence[int]) -> torch.Tensor:
    """Sum a plain tensor (one rank's partial sum) over ``mesh`` axes ``axes``.

    Autograd sees the identity: every rank's partial sum gets the (replicated)
    gradient of the total. Megatron's row-parallel "g" operator.
    """
    if torch.is_grad_enabled() and value.requires_grad:
        return _AllReduceSum.apply(value, mesh, tuple(axes))
    return _all_reduce(value, mesh, axes)


#: How long the all-reduce of a CPU tensor is polled before its thread blocks
#: (seconds; 0 blocks at once).
POLL_SECONDS = 0.05


def _all_reduce(value: torch.Tensor, mesh: Any, axes: Sequence[int]) -> torch.Tensor:
    value = value.clone(memory_format=torch.contiguous_format)
    shape = mesh.shape
    for axis in axes:
        if shape[axis] > 1:  # a sum over one rank is its own value
            _reduce_in_place(value, mesh.get_group(axis))
    return value


def all_reduce_sums(values: Sequence[torch.Tensor], group: Any) -> list[torch.Tensor]:
    """``values`` (plain tensors) summed over ``group``: one all-reduce per dtype.

    Each dtype's values are concatenated into one copy, reduced, and split.
    """
    out = list(values)
    for dtype in dict.fromkeys(v.dtype for v in values):
        picked = [i for i, v in enumerate(values) if v.dtype == dtype]
        flat = torch.cat([values[i].reshape(-1) for i in picked])
        _reduce_in_place(flat, group)
        start = 0
        for i in picked:
            size = values[i].numel()
            out[i] = flat[start : start + size].reshape(values[i].shape)
            start += size
    return out


def _reduce_in_place(value: torch.Tensor, group: Any) -> None:
    """The one all-reduce (sum) path: polled on CPU eagerly, traced as is."""
    if torch.compiler.is_compiling():
        torch.distributed.all_reduce(value, group=group)
        return
    work = torch.distributed.all_reduce(value, group=group, async_op=True)
    if value.device.type == "cpu":
        _poll(work)
    work.wait()


def _poll(work: Any) -> None:
    """Wait for gloo work by polling it, yielding the core between polls.

    Blocked on the work's condition variable, the thread leaves its core idle,
    and waking it again took most of the wait on a VM (in-process A/B, eager
    MLP on 2 gloo ranks: -23% and -26% wall per step). Polling stops after
    :data:`POLL_SECONDS`; ``work.wait()`` then blocks (and raises a failure).
    CUDA work is never polled: its wait only orders streams.
    """
    deadline = time.perf_counter() + POLL_SECONDS
    while not work.is_completed() and time.perf_counter() < deadline:
        _yield()


_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, value: torch.Tensor, mesh: Any, axes: tuple) -> torch.Tensor:
        return _all_reduce(value, mesh, axes)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None, None]:
        return grad, None, None


#: DTensorSpecs by what they are built from: building one costs more than the
#: rest of a small op. Each DTensor gets its own (shallow) copy.
_SPECS: dict[tuple, Any] = {}


def _copy(spec: Any, new: Any = object.__new__) -> Any:
    """A shallow copy of a DTensorSpec: what ``copy.copy`` does, 8x cheaper."""
    state = getattr(spec, "__dict__", None)
    if state is None:  # a torch with slotted specs
        return copy.copy(spec)
    clone = new(spec.__class__)
    clone.__dict__.update(state)
    return clone


def _remember(key: tuple, spec: Any) -> Any:
    if len(_SPECS) >= 1024:
        _SPECS.clear()
    _SPECS[key] = spec
    return spec


def _spec(mesh: Any, placements: tuple, meta: Any) -> Any:
    """The (cached) DTensorSpec of ``mesh``, ``placements`` and a TensorMeta."""
    key = (mesh, placements, meta)
    spec = _SPECS.get(key)
    if spec is None:
        spec = _remember(key, _SPEC[0](mesh, placements, tensor_meta=meta))
    return spec


def _spec_internals() -> tuple[Any, Any, Any] | None:
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        from torch.distributed.tensor._utils import compute_global_tensor_info
    except ImportError:  # pragma: no cover - torch moved them
        return None
    return DTensorSpec, TensorMeta, compute_global_tensor_info


_SPEC = _spec_internals()


def same_mesh(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` are the same DeviceMesh.

    Identity is the usual case (one torch mesh per Keras mesh) and the cheap
    test; DeviceMesh's equality covers a mesh built twice. Traced, the answer
    is yes: dynamo's identity test on a DeviceMesh can change between the
    analysis of a frame and its restart after a graph break (a
    SpeculationLogDivergence), and a Keras distribution has one mesh, which
    the eager steps before have checked.
    """
    if torch.compiler.is_compiling():
        return True
    return a is b or a == b


def replicate(value: torch.Tensor, mesh: Any) -> DTensor:
    """Wrap a plain tensor holding the full value as a Replicate DTensor on ``mesh``."""
    return wrap_local(value, mesh, [Replicate()] * mesh.ndim)


def replicated_locals(values: Sequence[Any]) -> tuple[Any, list[Any]] | None:
    """The mesh and ``values`` with each DTensor as its local tensor, or None.

    Only when an op on them may run locally: every DTensor is fully
    replicated on one mesh, nothing needs a gradient, every plain tensor with
    dims sits on the mesh's device (it is then taken as the full value, as
    :func:`promote` takes it) and nothing is being traced. Each rank then
    computes the full result, the same everywhere, with no DTensor dispatch.
    """
    if torch.compiler.is_compiling():
        return None
    grad = torch.is_grad_enabled()
    mesh = None
    local = []
    for value in values:
        if isinstance(value, DTensor):
            if (grad and value.requires_grad) or not is_replicated(value):
                return None
            if mesh is None:
                mesh = value.device_mesh
            elif not same_mesh(value.device_mesh, mesh):
                return None
            value = value._local_tensor
        elif isinstance(value, torch.Tensor):
            if grad and value.requires_grad:
                return None
        elif isinstance(value, (list, tuple)) and find_dtensor(value) is not None:
            return None
        local.append(value)
    if mesh is None:
        return None
    for value in local:
        if isinstance(value, torch.Tensor) and value.ndim:
            if value.device.type != mesh.device_type:
                return None
    return mesh, local


def replicate_result(result: Any, mesh: Any) -> Any:
    """Each tensor in ``result`` (lists and tuples inside) as a Replicate DTensor."""
    if isinstance(result, torch.Tensor) and not isinstance(result, DTensor):
        return replicate(result, mesh)
    if isinstance(result, (list, tuple)):
        return type(result)(replicate_result(r, mesh) for r in result)
    return result


def local_shard_dim(value: torch.Tensor, partner: DTensor) -> int | None:
    """The dim where ``value`` has the partner's *local* size, not its global one.

    Such a tensor is most likely one rank's shard of a sharded value (a per-rank
    data batch, a ``to_local()`` result): promoting it as Replicate would be
    wrong. Only meaningful for elementwise (broadcasting) ops.
    """
    if value.ndim != partner.ndim:
        return None
    local_shape = partner._local_tensor.shape
    for placement in partner.placements:
        if isinstance(placement, Shard):
            dim = placement.dim % partner.ndim
            size = value.shape[dim]
            if size != 1 and size == local_shape[dim] != partner.shape[dim]:
                return dim
    return None


def promote(
    value: torch.Tensor, partner: DTensor, *, op: str = "op", elementwise: bool = True
) -> DTensor:
    """Promote plain ``value`` next to ``partner`` as a Replicate DTensor.

    Raises :class:`PromotionError` when ``value`` looks like a per-rank shard.
    """
    if elementwise:
        dim = local_shard_dim(value, partner)
        if dim is not None:
            raise PromotionError(
                f"{op}: a plain {describe(value)} meets {describe(partner)}. Its "
                f"dim {dim} has the size of one rank's shard "
                f"({value.shape[dim]}), not the global size "
                f"({partner.shape[dim]}), so it looks like a per-rank shard;",
                "promoting it as the full (replicated) value would be wrong. "
                "Distribute it first: keras.distribution.distribute_tensor(x, "
                "layout) for a full value, or the backend's "
                "distribute_data_input(x, layout) for a per-process batch.",
            )
    return replicate(value, partner.device_mesh)


def promote_args(
    values: Sequence[Any], partner: DTensor, *, op: str = "op", elementwise: bool = True
) -> list[Any]:
    """Promote every non-scalar plain tensor in ``values`` (and one level of lists)."""

    def one(value: Any) -> Any:
        if _is_plain(value) and value.ndim:
            return promote(value, partner, op=op, elementwise=elementwise)
        if isinstance(value, (list, tuple)) and any(
            _is_plain(v) and v.ndim for v in value
        ):
            return type(value)(
                promote(v, partner, op=op, elementwise=elementwise)
                if _is_plain(v) and v.ndim
                else v
                for v in value
            )
        return value

    return [one(v) for v in values]


def _trivial_taken(mesh: Any, have: tuple, want: tuple) -> tuple:
    """``have`` with ``want``'s placement on every mesh axis of one rank."""
    sizes = mesh.shape
    return tuple(w if n == 1 else h for h, w, n in zip(have, want, sizes, strict=True))


class _Relabel(torch.autograd.Function):
    """New placements on one-rank mesh axes only: the same local tensor.

    On a mesh axis of one rank every placement holds the same data (a sum of
    one term is the total, one shard is the whole), yet ``redistribute``
    issues a collective over that one-rank group for a Partial one.
    """

    @staticmethod
    def forward(ctx: Any, value: DTensor, placements: tuple) -> DTensor:
        ctx.placements = tuple(value.placements)
        spec = _copy(_spec(value.device_mesh, placements, value._spec.tensor_meta))
        local = value._local_tensor
        return DTensor(local.view_as(local), spec, requires_grad=value.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if isinstance(grad, DTensor):
            grad = settle(grad, ctx.placements)
        return grad, None


def settle(value: DTensor, placements: Sequence[Any]) -> DTensor:
    """``value.redistribute`` to ``placements`` on its mesh, free on one-rank axes.

    Placements that differ only on mesh axes of one rank are relabelled
    (:class:`_Relabel`, or ``from_local`` when traced); the rest is
    redistributed. A torch without the spec internals redistributes as is.
    """
    placements = tuple(placements)
    have = tuple(value.placements)
    if have == placements:
        return value
    mesh = value.device_mesh
    if _SPEC is None:
        return value.redistribute(mesh, placements)
    relabelled = _trivial_taken(mesh, have, placements)
    if relabelled != have:
        if torch.compiler.is_compiling():
            # Traced (a compiled backward of an eager _Relabel too):
            # to_local/from_local relabel; redistribute refuses "to Partial".
            value = DTensor.from_local(
                value.to_local(),
                mesh,
                relabelled,
                run_check=False,
                shape=value.shape,
                stride=value.stride(),
            )
        else:
            value = _Relabel.apply(value, relabelled)
    if relabelled != placements:
        value = value.redistribute(mesh, placements)
    return value


def placed(value: DTensor, placements: Sequence[Any]) -> DTensor:
    """:func:`settle`, once per activation and placements.

    An activation (not a leaf: nothing assigns to it) keeps what it was
    redistributed to, so its readers share one redistribution and its
    backward: a loss and an accuracy metric on the same vocabulary-sharded
    logits gather them once, and Q, K and V sharding one replicated input on
    the axis they contract sum their gradients before the one all-gather. A
    compiled graph needs this too: inductor does not merge collectives. A
    result made without gradient serves only callers without; one made before
    an in-place change to the activation (eager: its version) is not reused.
    """
    placements = tuple(placements)
    if value.is_leaf:
        return settle(value, placements)
    grad = torch.is_grad_enabled()
    # Dynamo reads no version counter; a traced activation is not changed in
    # place between its readers here (Keras's layers return new tensors).
    version = None if torch.compiler.is_compiling() else value._version
    kept = getattr(value, _PLACED, None)
    if kept is None:
        kept = []
        setattr(value, _PLACED, kept)
    for have, at, with_grad, result in kept:
        if have == placements and at == version and (with_grad or not grad):
            return result
    result = settle(value, placements)
    # It replaces what it serves better: a stale one, or one without gradient.
    kept[:] = [entry for entry in kept if entry[0] != placements]
    kept.append((placements, version, grad, result))
    return result


#: The attribute :func:`placed` keeps an activation's redistributions in.
_PLACED = "_keras_dtensor_fix_placed"


def to_placements(value: torch.Tensor, like: DTensor) -> DTensor:
    """Return ``value`` with ``like``'s mesh and placements.

    A plain tensor of ``like``'s global shape is taken as the full value; one of
    its local shape as this rank's shard. A DTensor is redistributed (a
    ``Partial`` gradient becomes reduced, for instance).
    """
    mesh, placements = like.device_mesh, tuple(like.placements)
    if isinstance(value, DTensor):
        if not same_mesh(value.device_mesh, mesh):
            return value.redistribute(mesh, placements)
        return settle(value, placements)
    if tuple(value.shape) == tuple(like.shape):
        return replicate(value, mesh).redistribute(mesh, placements)
    if tuple(value.shape) == tuple(like._local_tensor.shape):
        return wrap_local(value, mesh, placements)
    raise PromotionError(
        f"a plain {describe(value)} cannot take the layout of {describe(like)}: "
        "its shape is neither the global nor the local shape."
    )


def is_replicated(value: DTensor) -> bool:
    """Whether ``value`` holds the same full value on every rank."""
    return all(p.is_replicate() for p in value.placements)


def without_partials(placements: Sequence[Any]) -> tuple:
    """``placements`` with every partial one (a pending reduction) replicated."""
    return tuple(Replicate() if p.is_partial() else p for p in placements)


def reduce_partial(value: Any) -> Any:
    """``value`` with its ``Partial`` mesh axes reduced to ``Replicate``.

    What Megatron's row-parallel layer does with its output. Left Partial, the
    first nonlinear op reduces it in the forward pass and its backward reduces
    the saved Partial input a second time. Eager sums take one c10d
    all-reduce per axis (:class:`_SumPartial`); anything else (another reduce
    op, a traced step) goes through ``redistribute``.
    """
    if not isinstance(value, DTensor):
        return value
    placements = tuple(value.placements)
    if not any(p.is_partial() for p in placements):
        return value
    settled = without_partials(placements)
    value = settle(value, _trivial_taken(value.device_mesh, placements, settled))
    placements = tuple(value.placements)
    if placements == settled:
        return value
    if (
        _SPEC is not None
        and not torch.compiler.is_compiling()
        and all(
            type(p) is Partial and p.reduce_op == "sum"
            for p in placements
            if p.is_partial()
        )
    ):
        return _SumPartial.apply(value, settled)
    return value.redistribute(value.device_mesh, settled)


def reduce_masked(value: Any) -> Any:
    """``value`` reduced at once if it is partial with a one-shot mask.

    A lookup in a table sharded on its rows (an embedding sharded on the
    vocabulary) gives a ``_MaskPartial`` value whose mask torch releases at
    its first reduction: a second use of the unreduced value (a layer norm
    that reads it twice) fails. Reduced where it is made, it is plain
    Replicate, as Megatron's vocabulary-parallel embedding returns it.
    """
    if isinstance(value, DTensor) and any(
        p.is_partial() and type(p) is not Partial for p in value.placements
    ):
        settled = without_partials(value.placements)
        return _ReduceMasked.apply(value, settled)
    return value


def vocab_parallel_lookup(table: Any, ids: Any) -> DTensor | None:
    """``embedding(ids, table)`` for a table split on its rows, with no mask state.

    DTensor's own lookup returns a ``_MaskPartial`` value that carries its mask
    from the lookup to the reduction in a Python buffer. A traced step cannot
    hold that: dynamo runs an autograd.Function's forward twice (once to trace
    it, once for its output), the first run releases the mask and the second
    finds none, and inductor meets the traced run's fake mask in its own fake
    mode. Here each rank looks its ids up in its own rows, zeroes the rows it
    does not hold and the partial sums are reduced: Megatron's
    vocabulary-parallel embedding, the same values and gradients, all in
    traceable DTensor calls. Negative ids count from the end, as Keras's
    ``take`` does. Returns ``None`` when ``table`` is not a 2-D DTensor split on
    its rows by exactly one mesh axis (DTensor's own rule then runs).
    """
    if not isinstance(table, DTensor) or table.ndim != 2:
        return None
    mesh = table.device_mesh
    rows = [i for i, p in enumerate(table.placements) if p == Shard(0)]
    if len(rows) != 1 or any(p.is_partial() for p in table.placements):
        return None
    if isinstance(ids, DTensor):
        if not same_mesh(ids.device_mesh, mesh):
            return None
        if any(p.is_partial() for p in ids.placements):
            return None
        axis = rows[0]
        id_placements = tuple(
            Replicate() if i == axis else p for i, p in enumerate(ids.placements)
        )
        if id_placements != tuple(ids.placements):
            ids = ids.redistribute(mesh, id_placements)
        local_ids = ids.to_local()
    else:
        id_placements = (Replicate(),) * mesh.ndim
        local_ids = ids
    axis = rows[0]
    out_placements = []
    table_grads = []
    for i, (mine, theirs) in enumerate(
        zip(table.placements, id_placements, strict=True)
    ):
        if i == axis:
            out_placements.append(Partial())
            table_grads.append(mine)
        elif isinstance(mine, Shard) and isinstance(theirs, Shard):
            return None  # gather_axes_splitting gathers such a table first
        elif isinstance(mine, Shard):  # the embedding dim
            out_placements.append(Shard(local_ids.ndim))
            table_grads.append(mine)
        else:  # a replicated table, ids split or not
            out_placements.append(theirs)
            # Each rank's rows of ids give part of the table's gradient.
            table_grads.append(Partial() if isinstance(theirs, Shard) else mine)
    vocab = table.shape[0]
    size, offset = Shard.local_shard_size_and_offset(
        vocab, mesh.size(axis), mesh.get_coordinate()[axis]
    )
    local_ids = local_ids.long()
    local_ids = torch.where(local_ids < 0, local_ids + vocab, local_ids)
    outside = (local_ids < offset) | (local_ids >= offset + size)
    shifted = torch.where(outside, 0, local_ids - offset)
    local_table = table.to_local(grad_placements=tuple(table_grads))
    found = torch.nn.functional.embedding(shifted, local_table)
    found = found.masked_fill(outside.unsqueeze(-1), 0)
    partial = DTensor.from_local(found, mesh, tuple(out_placements), run_check=False)
    settled = without_partials(out_placements)
    return partial.redistribute(mesh, settled)


class _ReduceMasked(torch.autograd.Function):
    """Reduce a masked partial value; its gradient goes back replicated.

    ``redistribute``'s own backward would turn a Partial gradient into the
    mask placement, which torch does not support (tied embeddings give one).
    """

    @staticmethod
    def forward(ctx: Any, value: DTensor, settled: tuple) -> DTensor:
        return value.redistribute(value.device_mesh, settled)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, None]:
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            settled = without_partials(grad.placements)
            grad = grad.redistribute(grad.device_mesh, settled)
        return grad, None


class _SumPartial(torch.autograd.Function):
    """Partial("sum") to Replicate with plain c10d all-reduces.

    The same result and gradient as ``redistribute`` (whose backward keeps a
    replicated gradient replicated), without its functional-collective
    machinery, which on a CPU (gloo) step costs more than the all-reduce.
    """

    @staticmethod
    def forward(ctx: Any, value: DTensor, settled: tuple) -> DTensor:
        mesh = value.device_mesh
        ctx.placements = settled
        axes = [axis for axis, p in enumerate(value.placements) if p.is_partial()]
        local = _all_reduce(value._local_tensor, mesh, axes)
        spec = _copy(_spec(mesh, settled, value._spec.tensor_meta))
        return DTensor(local, spec, requires_grad=value.requires_grad)

    @staticmethod
    def backward(ctx: Any, grad: DTensor) -> tuple[DTensor, None]:
        return settle(grad, ctx.placements), None


def gather_non_batch_axes(value: Any, batch_dim_name: str | None) -> Any:
    """This process's rows of ``value``: sharded on the batch mesh axis only.

    Every other mesh axis is gathered, so a model-axis-sharded output comes
    back whole. Non-DTensors pass through.
    """
    if not isinstance(value, DTensor):
        return value
    mesh = value.device_mesh
    names = mesh.mesh_dim_names or (None,) * mesh.ndim
    placements = [
        Shard(0) if value.ndim and name == batch_dim_name else Replicate()
        for name in names
    ]
    return value.redistribute(mesh, placements).to_local()


def batch_parallel_call(
    fn: Any, value: Any, weights: Sequence[Any], mesh: Any
) -> DTensor:
    """``fn(value, *weights)`` per rank: weights gathered, ``value`` only batch-split.

    For ops DTensor has no rule for on the placements at hand (a convolution
    whose kernel or input channels are sharded: torch's conv handler knows
    only replicated and width-sharded operands and mislabels the rest). Each
    mesh axis that splits ``value`` on dim 0 keeps splitting it; every other
    axis is gathered, and the result has the batch placements. A weight's
    gradient is a Partial sum over the batch axes (reduced by autograd where
    its redistribution back to the weight's placements runs). Plain operands
    are taken as full values.
    """
    batch = (
        tuple(
            Shard(0) if isinstance(p, Shard) and p.dim == 0 else Replicate()
            for p in (value.placements if isinstance(value, DTensor) else ())
        )
        or (Replicate(),) * mesh.ndim
    )
    full = (Replicate(),) * mesh.ndim
    weight_grads = tuple(Partial() if p == Shard(0) else p for p in batch)
    if isinstance(value, DTensor):
        value = value.redistribute(mesh, batch).to_local(grad_placements=batch)
    local = []
    for weight in weights:
        if isinstance(weight, DTensor):
            weight = weight.redistribute(mesh, full).to_local(
                grad_placements=weight_grads
            )
        local.append(weight)
    return DTensor.from_local(fn(value, *local), mesh, batch, run_check=False)


def update_in_place_of(
    inputs: Any, updates: Any
) -> tuple[Any, torch.Tensor, torch.Tensor, tuple] | None:
    """Local operands for writing ``updates`` into a copy of ``inputs``.

    For ops that write one tensor into another (a KV cache's slice update):
    with a plain or differently placed target, DTensor's in-place copy would
    need to change the target's placements, which it refuses. Both take the
    placements of ``updates`` (a plain ``inputs`` is the full value, split
    locally with no communication) wherever ``updates`` spans every sharded
    dim whole, so each rank writes its own part; otherwise both are gathered.
    Returns ``(mesh, local inputs, local updates, placements)`` or ``None``
    when neither is a DTensor. A Partial ``updates`` is reduced first.
    """
    partner = updates if isinstance(updates, DTensor) else inputs
    if not isinstance(partner, DTensor):
        return None
    mesh = partner.device_mesh
    if not isinstance(updates, DTensor):
        updates = replicate(updates, mesh)
    if not isinstance(inputs, DTensor):
        inputs = replicate(inputs, mesh)
    updates = reduce_partial(updates)
    placements = tuple(updates.placements)
    if not same_mesh(inputs.device_mesh, mesh) or any(
        isinstance(p, Shard) and updates.shape[p.dim] != inputs.shape[p.dim]
        for p in placements
    ):
        placements = (Replicate(),) * mesh.ndim
    local = [v.redistribute(mesh, placements).to_local() for v in (inputs, updates)]
    return mesh, local[0], local[1], placements


def gather_axes_splitting(table: Any, ids: Any) -> Any:
    """``table`` gathered on every mesh axis that also splits ``ids``.

    A layout that shards a weight on the batch axis too (keras-hub's 2-D
    layouts, FSDP style) splits an embedding table's columns on the axis
    that splits the ids' rows: no placement of the lookup holds both, and
    DTensor's embedding rule then pairs a mask of the local rows with the
    global rows (IndexError). Gathering those columns first is what FSDP does
    before a weight is used; its gradient is reduce-scattered back.
    """
    if not (isinstance(table, DTensor) and isinstance(ids, DTensor)):
        return table
    if not same_mesh(table.device_mesh, ids.device_mesh):
        return table
    placements = tuple(
        Replicate() if isinstance(mine, Shard) and isinstance(theirs, Shard) else mine
        for mine, theirs in zip(table.placements, ids.placements, strict=True)
    )
    if placements == tuple(table.placements):
        return table
    return table.redistribute(table.device_mesh, placements)


def gather_axis(value: Any, axis: int | None) -> Any:
    """``value`` gathered on the mesh axes that shard tensor dim ``axis``.

    ``axis=None`` gathers every sharded dim. An index reduction (``argmax``)
    over a sharded dim needs the whole dim: DTensor's own rule for it reads a
    scalar back from the tensor, a graph break that leaves DTensors as the
    outputs of a compiled graph.
    """
    if not isinstance(value, DTensor):
        return value
    dim = None if axis is None else axis % max(value.ndim, 1)
    placements = tuple(
        Replicate() if isinstance(p, Shard) and dim in (None, p.dim) else p
        for p in value.placements
    )
    if placements == tuple(value.placements):
        return value
    return placed(value, placements)
