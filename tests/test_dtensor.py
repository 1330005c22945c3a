"""Pure-torch helpers: polled all-reduce waits, ops on replicated local tensors."""

from __future__ import annotations

import time

import pytest


class _Work:
    """A c10d work stand-in that completes after ``polls`` polls (never: None)."""

    def __init__(self, polls: int | None) -> None:
        self.polls, self.seen = polls, 0

    def is_completed(self) -> bool:
        self.seen += 1
        return self.polls is not None and self.seen > self.polls


def test_poll_returns_when_the_work_completes(monkeypatch) -> None:
    from keras_dtensor_fix import dtensor

    monkeypatch.setattr(dtensor, "POLL_SECONDS", 10.0)
    work = _Work(polls=3)
    start = time.perf_counter()
    dtensor.poll_work(work)
    assert work.seen == 4 and time.perf_counter() - start < 5


@pytest.mark.parametrize("seconds", [0.0, 0.05])
def test_poll_gives_up_after_poll_seconds(monkeypatch, seconds: float) -> None:
    from keras_dtensor_fix import dtensor

    monkeypatch.setattr(dtensor, "POLL_SECONDS", seconds)
    start = time.perf_counter()
    dtensor.poll_work(_Work(polls=None))
    assert seconds <= time.perf_counter() - start < seconds + 2


@pytest.mark.parametrize("seconds", [0.0, 0.05])
def test_all_reduce_sum_polled_or_blocking(mesh1, monkeypatch, seconds) -> None:
    import torch

    from keras_dtensor_fix import dtensor

    monkeypatch.setattr(dtensor, "POLL_SECONDS", seconds)
    value = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    out = dtensor.all_reduce_sum(value, mesh1, [0])  # one rank: the same values
    assert torch.equal(out, value) and out is not value


def test_replicated_locals(mesh1) -> None:
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_fix.dtensor import replicate_result, replicated_locals

    full = torch.arange(4.0)
    rep = distribute_tensor(full, mesh1, [Replicate()])
    mesh, local = replicated_locals([rep, 2.0, torch.ones(4)])
    assert mesh is mesh1 and local[0] is rep._local_tensor and local[1] == 2.0
    result = replicate_result((local[0] + local[2], 1), mesh)
    assert tuple(result[0].placements) == (Replicate(),) and result[1] == 1
    assert torch.equal(result[0].full_tensor(), full + 1)
    # Sharded on a one-rank axis, each local tensor is the whole value.
    shard = distribute_tensor(full, mesh1, [Shard(0)])
    assert replicated_locals([shard])[1][0] is shard._local_tensor
    # Not for a gradient (this op carries none), a list holding a DTensor, or
    # no DTensor at all (the rest of the rule: test_planner.py).
    grad = distribute_tensor(full.clone().requires_grad_(), mesh1, [Replicate()])
    assert replicated_locals([grad]) is None
    with torch.no_grad():
        assert replicated_locals([grad]) is not None
    assert replicated_locals([[rep], rep]) is None
    assert replicated_locals([full, 1.0]) is None


def test_redistributed_relabels_one_rank_axes(mesh1, monkeypatch) -> None:
    """On a mesh axis of one rank a Partial sum is already the total: redistributed()
    relabels it (same storage, no collective), forward and backward."""
    import torch
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from keras_dtensor_fix import dtensor

    calls = []
    real = DTensor.redistribute
    monkeypatch.setattr(
        DTensor,
        "redistribute",
        lambda self, *a, **k: calls.append(a) or real(self, *a, **k),
    )
    local = torch.arange(3.0, requires_grad=True)
    partial = DTensor.from_local(local, mesh1, [Partial()], run_check=False)
    reduced = dtensor.redistributed(partial, (Replicate(),))
    assert tuple(reduced.placements) == (Replicate(),)
    assert reduced._local_tensor.data_ptr() == local.data_ptr()
    reduced.to_local().sum().backward()
    assert torch.equal(local.grad, torch.ones(3)) and calls == []
    reduced = dtensor.reduce_partial(DTensor.from_local(local, mesh1, [Partial()]))
    assert tuple(reduced.placements) == (Replicate(),) and calls == []


def test_placed_is_shared_by_an_activations_readers(mesh1) -> None:
    """An activation redistributes once per placements for all its readers, so
    their gradients meet before the one backward (Q, K and V share one
    all-gather); a weight (a leaf, assigned in place) and an activation changed
    in place are redistributed again, and a result made without gradient is
    not handed to a caller that needs one."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_fix.dtensor import placed

    weight = distribute_tensor(torch.arange(4.0), mesh1, [Replicate()])
    weight.requires_grad_(True)
    assert placed(weight, (Shard(0),)) is not placed(weight, (Shard(0),))

    activation = weight * 2
    with torch.no_grad():
        no_grad = placed(activation, (Shard(0),))
    assert no_grad.grad_fn is None
    first = placed(activation, (Shard(0),))
    assert first is not no_grad and first.grad_fn is not None
    assert placed(activation, (Shard(0),)) is first
    with torch.no_grad():
        assert placed(activation, (Shard(0),)) is first
    (first * 3 + first).sum().backward()
    assert torch.equal(weight.grad.full_tensor(), torch.full((4,), 8.0))

    other = weight * 2
    before = placed(other, (Shard(0),))
    with torch.no_grad():
        other.add_(1)
    after = placed(other, (Shard(0),))
    assert after is not before and torch.equal(after.full_tensor(), other.full_tensor())


def test_placed_keeps_nothing_on_a_view_of_a_weight(mesh1) -> None:
    """A view of a weight (keras-hub Gemma3n's tied logits read
    ``ops.transpose(embeddings)`` made once, at construction) outlives the
    step while the optimizer writes the weight's local shard in place unseen
    by the view's version counters: its redistribution is made again at each
    call, and so is its Megatron "f". Before, ``placed`` kept the first one,
    and a (2, 1) mesh trained Gemma3n's logits on the step-1 embedding
    (epoch-2 loss 4.0780 against one process's 4.0649)."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_fix.dtensor import placed, reducing_gradient

    weight = distribute_tensor(torch.arange(6.0).reshape(2, 3), mesh1, [Replicate()])
    weight.requires_grad_(True)
    view = weight.transpose(0, 1)
    first = placed(view, (Shard(0),))
    with torch.no_grad():
        weight._local_tensor.data.add_(1)  # no version counter sees it
    again = placed(view, (Shard(0),))
    assert again is not first
    assert torch.equal(again.full_tensor(), weight.full_tensor().T)
    assert reducing_gradient(view) is not reducing_gradient(view)


def test_on_mesh_moves_a_value_to_an_equal_mesh_object(mesh1) -> None:
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from keras_dtensor_fix.dtensor import on_mesh

    other = DeviceMesh("cpu", [0])  # equal to mesh1, another object
    assert other == mesh1 and other is not mesh1
    value = distribute_tensor(torch.arange(4.0), other, [Replicate()])
    moved = on_mesh(value, mesh1)
    assert moved.device_mesh is mesh1
    assert moved._local_tensor.data_ptr() == value._local_tensor.data_ptr()  # no copy
    assert moved.placements == value.placements and moved.shape == value.shape
    assert on_mesh(moved, mesh1) is moved  # already there
    plain = torch.ones(2)
    assert on_mesh(plain, mesh1) is plain


def test_fori_loop_carries_take_a_bodys_dtensors(mesh1) -> None:
    """A ``fori_loop`` body that closes over a DTensor and writes its values
    into a plain carry in place (keras-hub's RWKV-7 time mix): the plugin
    makes the carries Replicate DTensors, and values and gradients equal the
    plain loop's. Keras's own loop (the wrapper's original) fails DTensor's
    assertion that an in-place op's self is a DTensor."""
    import keras
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from keras_dtensor_fix.dtensor import implicit_replication, set_implicit_replication

    def run(weight, loop):
        def step(t, carries):
            out, total = carries
            out[t : t + 1] = weight * (t + 1)  # Python's write, as RWKV-7's
            return [out, total + weight.sum()]

        return loop(0, 3, step, [torch.zeros(3, 4), torch.zeros(())])

    fori_loop = keras.src.backend.torch.ops.core.fori_loop
    full = torch.arange(4.0).reshape(1, 4)
    plain = full.clone().requires_grad_()
    expected = run(plain, fori_loop)
    (expected[0] ** 2).sum().backward()
    was = implicit_replication()
    set_implicit_replication(True)
    try:
        weight = distribute_tensor(full, mesh1, [Shard(1)]).requires_grad_()
        with pytest.raises(AssertionError):
            run(weight, getattr(fori_loop, "__wrapped__", fori_loop))
        out, total = run(weight, keras.ops.fori_loop)
        assert isinstance(out, DTensor) and total.ndim == 0
        assert torch.equal(out.full_tensor(), expected[0].detach())
        (out**2).sum().backward()
        assert torch.equal(weight.grad.full_tensor(), plain.grad)
    finally:
        set_implicit_replication(was)


def test_an_unused_compiled_output_gets_a_dtensor_gradient(mesh1) -> None:
    """A compiled function with two DTensor outputs, backward from the first
    alone (a decoder block's hidden states and its KV cache, blocks mode):
    torch 2.13 refuses the plain zeros autograd gives the second ("Expected a
    DTensor tangent but got a plain Tensor"); ``zero_gradients_if_unused`` of
    both outputs gives the second a DTensor of zeros, the eager gradient."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    from keras_dtensor_fix.dtensor import zero_gradients_if_unused

    def block(x, weight):
        return x * weight, x + weight

    full = torch.arange(4.0).reshape(2, 2)
    eager = full.clone().requires_grad_()
    (block(eager, 3.0)[0] ** 2).sum().backward()
    compiled = torch.compile(block, backend="aot_eager", dynamic=False)
    for fixed in (False, True):
        torch._dynamo.reset()
        x = distribute_tensor(full, mesh1, [Shard(0)]).requires_grad_()
        hidden, cache = compiled(x * 1.0, 3.0)
        if not fixed:
            with pytest.raises(RuntimeError, match="got a plain Tensor"):
                (hidden**2).sum().backward()
            continue
        hidden, cache = zero_gradients_if_unused((hidden, cache))
        (hidden**2).sum().backward()
        assert torch.equal(x.grad.full_tensor(), eager.grad)


def test_a_regions_kept_redistribution_reaches_eager_readers(mesh1) -> None:
    """A compiled region whose output a reader redistributed inside (the
    tail's loss gathering the logits: ``placed`` keeps the result on them):
    kept there, the result leaves the graph as one more output, gets no
    gradient, and torch 2.13's backward refuses autograd's plain zeros.
    ``without_kept`` drops it in the graph and ``kept_detached``/``keep`` hand
    it, detached, to the eager output, where the next reader (a metric)
    finds it; the gradient is the eager one."""
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from keras_dtensor_fix.dtensor import (
        keep,
        kept_detached,
        placed,
        without_kept,
        zero_gradients_if_unused,
    )

    def head(x):
        logits = x * 2.0
        return logits, placed(logits, (Replicate(),)).sum()

    def head_dropping(x):
        logits, loss = head(x)
        kept = kept_detached(logits)
        return (without_kept(logits), loss), kept

    full = torch.arange(4.0)
    for fixed in (False, True):
        torch._dynamo.reset()
        x = distribute_tensor(full, mesh1, [Shard(0)]).requires_grad_()
        if not fixed:
            compiled = torch.compile(head, backend="aot_eager", dynamic=False)
            logits, loss = compiled(x * 1)
            with pytest.raises(RuntimeError, match="got a plain Tensor"):
                loss.backward()
            continue
        compiled = torch.compile(head_dropping, backend="aot_eager", dynamic=False)
        (logits, loss), kept = compiled(x * 1)
        logits, loss = zero_gradients_if_unused([logits, loss])
        keep(logits, kept)
        gathered = placed(logits, (Replicate(),))
        assert gathered is kept[0][1] and gathered.grad_fn is None
        loss.backward()
        assert torch.equal(x.grad.full_tensor(), torch.full((4,), 2.0))


def test_rms_normalization_over_a_split_hidden_dim(mesh1) -> None:
    """``rms_normalization`` of hidden states split on their last dim (an
    embedding's (model, batch) layout on a one-rank batch axis: SmolLM3's
    norms), compiled: torch's ``rms_norm`` adds epsilon in place to a Partial
    mean, which DTensor refuses ("in-place operations that require placement
    changes", eagerly and traced; upstream fails it too). The ``normalized``
    handler gathers the normalized axis first: the one-process values."""
    import keras
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    nn = keras.src.backend.torch.ops.nn  # the ops family's wrapped module
    x, scale = torch.randn(2, 3, 8), torch.randn(8)
    expected = nn.rms_normalization.__wrapped__(x, scale, epsilon=1e-6)
    split = distribute_tensor(x, mesh1, [Shard(2)])
    whole = distribute_tensor(scale, mesh1, [Replicate()])
    for fixed in (False, True):
        torch._dynamo.reset()
        norm = nn.rms_normalization if fixed else nn.rms_normalization.__wrapped__
        compiled = torch.compile(norm, backend="aot_eager", dynamic=False)
        if not fixed:
            with pytest.raises(Exception, match="placement changes"):
                compiled(split, whole, axis=[-1], epsilon=1e-6)
            continue
        # a list of axes, as keras.layers.RMSNormalization passes it
        got = compiled(split, whole, axis=[-1], epsilon=1e-6)
        torch.testing.assert_close(got.full_tensor(), expected)


@pytest.mark.parametrize("keyword", [False, True])
def test_a_replicated_scalar_is_placed_without_a_broadcast(
    mesh1, monkeypatch, keyword: bool
) -> None:
    """Keras's ``distribute_tensor`` of a plain scalar on a replicated layout (an
    optimizer's step count, a metric's total) is the same value everywhere: the
    ``variables`` family places it without torch's ``distribute_tensor`` (a
    broadcast), its layout passed by position or by keyword. Upstream broadcasts
    it. Can it fail: with the layout read as None when passed by keyword, the
    keyword case reaches torch's ``distribute_tensor``."""
    import keras
    import torch
    from torch.distributed import tensor as torch_tensor

    def broadcast(*args, **kwargs):
        raise AssertionError("torch's distribute_tensor ran (a broadcast)")

    lib = keras.src.backend.torch.distribution_lib
    mesh = keras.distribution.DeviceMesh((1,), ["model"], ["cpu:0"])
    layout = keras.distribution.TensorLayout([], mesh)
    monkeypatch.setattr(torch_tensor, "distribute_tensor", broadcast)
    value = torch.tensor(3.0)
    placed = (
        lib.distribute_tensor(value, layout=layout)
        if keyword
        else lib.distribute_tensor(value, layout)
    )
    assert isinstance(placed, torch_tensor.DTensor)
    assert placed.placements[0].is_replicate() and placed.full_tensor().item() == 3.0
