"""The one local-execution planner (``dtensor.planner``), its cases in one place.

Pure decisions on placements: the DTensors here are metadata on meshes of 2 or
4 ranks built without process groups (beside the session's one-rank group);
nothing computes. What each caller does with a plan is tested with it: two
gloo ranks for einsum (``test_einsum.py``), every model for the rest.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402
from torch.distributed.tensor import Partial, Replicate, Shard  # noqa: E402

R = Replicate()


@pytest.fixture(scope="module")
def meshes(mesh1):
    """Meshes of shape (2,), (2, 2) and (1, 2), built without process groups."""
    from torch.distributed.device_mesh import DeviceMesh

    def make(*shape: int) -> DeviceMesh:
        ranks = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
        return DeviceMesh("cpu", ranks, _init_backend=False)

    return {"2": make(2), "2x2": make(2, 2), "1x2": make(1, 2)}


def dt(mesh, shape, *placements, grad: bool = False):
    """A DTensor of global ``shape`` so placed (its local data is never read)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    local = torch.zeros(shape)
    meta = TensorMeta(torch.Size(shape), local.stride(), local.dtype)
    spec = DTensorSpec(mesh, tuple(placements), meta)
    return DTensor(local, spec, requires_grad=grad)


# -- product: an einsum ------------------------------------------------------


@pytest.mark.parametrize(
    ("equation", "shapes", "placements", "expected"),
    [
        # Column parallel: the replicated input's gradient is a partial sum.
        ("abk,kn->abn", ((4, 3, 6), (6, 8)), ((R,), (Shard(1),)),
         ((Shard(2),), ((Partial(),), (Shard(1),)), ())),
        # Row parallel: the output is a partial sum, all-reduced on the way out.
        ("abk,kn->abn", ((4, 3, 6), (6, 8)), ((Shard(2),), (Shard(0),)),
         ((Partial(),), ((Shard(2),), (Shard(0),)), (0,))),
        # Two mesh axes: one replicated everywhere, one sharding the heads.
        ("aecd,abcd->acbe", ((2, 5, 4, 3),) * 2, ((R, Shard(2)), (R, Shard(2))),
         ((R, Shard(1)), ((R, Shard(2)), (R, Shard(2))), ())),
    ],
)  # fmt: skip
def test_product(equation, shapes, placements, expected) -> None:
    from keras_dtensor_fix.dtensor.planner import product

    mesh_shape = (2,) * len(placements[0])
    assert product(equation, shapes, placements, mesh_shape) == expected


def test_product_one_rank_axis() -> None:
    """A (1, 2) mesh's first axis holds everything on its one rank: keras-hub's
    layouts shard two letters on it, which is no obstacle there, and nothing
    is summed over it."""
    from keras_dtensor_fix.dtensor.planner import product

    placements = ((Shard(2), Shard(2)), (Shard(1), Shard(0)))
    shapes = ((4, 3, 6), (6, 2, 8))
    found = product("bqm,muh->bquh", shapes, placements, (1, 2))
    assert found == ((R, Partial()), placements, (1,))
    assert product("bqm,muh->bquh", shapes, placements, (2, 2)) is None


@pytest.mark.parametrize(
    ("equation", "shapes", "placements"),
    [
        ("abk,kn->abn", ((4, 3, 6), (6, 8)), ((Shard(2),), (R,))),  # k unsharded in B
        ("ij,jk->ik", ((3, 4), (4, 5)), ((R,), (Shard(1),))),  # uneven
        ("ij,jk->ik", ((4, 4), (4, 6)), ((Partial(),), (R,))),  # Partial operand
        ("...k,kn->...n", ((4, 6), (6, 8)), ((R,), (Shard(1),))),  # ellipsis
        ("ik,kn->in", ((4, 1), (6, 8)), ((R,), (Shard(1),))),  # broadcast letter
        ("ii,ij->ij", ((4, 4), (4, 6)), ((R,), (Shard(1),))),  # repeated letter
        ("ij,jk->ik", ((4, 4), (4, 6)), ((Shard(0),), (Shard(1),))),  # two letters
    ],
)
def test_no_product(equation, shapes, placements) -> None:
    from keras_dtensor_fix.dtensor.planner import product

    assert product(equation, shapes, placements, (2,)) is None


def test_aligned_gathers_a_second_letter_and_splits_a_replicated_holder() -> None:
    from keras_dtensor_fix.dtensor.planner import aligned, product

    # keras-hub: the kernel sharded on "batch" next to batch-split activations.
    placements = ((Shard(0), R), (Shard(1), Shard(0)))
    wanted = aligned("bk,kn->bn", placements, (2, 2))
    assert wanted == ((Shard(0), Shard(1)), (R, Shard(0)))
    assert product("bk,kn->bn", ((4, 6), (6, 8)), wanted, (2, 2)) is not None
    # A one-rank axis keeps both letters; an unparsed equation is untouched.
    assert aligned("bk,kn->bn", placements, (1, 2))[1] == (Shard(1), Shard(0))
    assert aligned("...k,kn->...n", placements, (2, 2)) == placements


# -- replicated: an op, a loss, a metric update --------------------------------


def test_replicated_takes_whole_values_and_one_rank_axes(meshes) -> None:
    from keras_dtensor_fix.dtensor.planner import replicated

    m = meshes["2x2"]
    assert replicated([dt(m, (4, 6), R, R), 2.0, torch.ones(6)]) is m
    assert replicated([dt(m, (4, 6), R, Shard(1))]) is None
    # Sharded on a one-rank axis is whole on each rank: the same rule as a
    # layer's and an einsum's (the op and loss paths refused it before).
    one = meshes["1x2"]
    assert replicated([dt(one, (4, 6), Shard(0), R)]) is one


def test_replicated_partial_only_where_the_caller_reduces(meshes) -> None:
    from keras_dtensor_fix.dtensor.planner import replicated

    m = meshes["2x2"]
    pending = dt(m, (4, 6), R, Partial())
    assert replicated([pending]) is None  # an op keeps the pending sum
    assert replicated([pending], partial=True) is m  # a loss reduces it first
    assert replicated([dt(m, (4, 6), Shard(0), Partial())], partial=True) is None


def test_replicated_refusals(meshes) -> None:
    from keras_dtensor_fix.dtensor.planner import replicated

    m, other = meshes["2x2"], meshes["2"]
    whole = dt(m, (4, 6), R, R)
    assert replicated([whole, dt(other, (4, 6), R)]) is None  # two meshes
    assert replicated([[whole], whole]) is None  # a DTensor inside a list
    assert replicated([whole, torch.ones(6, device="meta")]) is None  # device
    assert replicated([torch.ones(6)]) is None  # no mesh at all
    assert replicated([torch.ones(6)], mesh=m) is m  # the caller's mesh
    needs = dt(m, (4, 6), R, R, grad=True)
    assert replicated([needs]) is m
    assert replicated([needs], gradients=False) is None
    with torch.no_grad():
        assert replicated([needs], gradients=False) is m


# -- region: a layer -----------------------------------------------------------


def test_region_whole_and_split_alike(meshes) -> None:
    from keras_dtensor_fix.dtensor.planner import region

    m = meshes["2x2"]
    assert region([dt(m, (2, 4, 8), R, R), 1.0], None) == (m, (R, R))
    heads = dt(m, (2, 4, 8), R, Shard(1))
    # A softmax over the last dim runs on head shards; the mask is whole
    # along the heads (size 1 there).
    found = region([heads, dt(m, (2, 4, 8), R, Shard(1)), torch.ones(2, 1, 8)], {2})
    assert found == (m, (R, Shard(1)))
    assert region([heads], {1}) is None  # reads across the split dim
    assert region([heads], None) is None  # unknown: must be whole
    assert region([heads, torch.ones(2, 4, 8)], {2}) is None  # a whole operand
    assert region([heads, dt(m, (2, 4, 8), R, R)], {2}) is None  # ditto, DTensor
    assert region([heads, dt(m, (2, 4, 8), Shard(2), Shard(1))], {1}) is None
    assert region([heads, dt(m, (2, 4, 8), R, Shard(0))], {2}) is None
    assert region([dt(m, (2, 4, 8), R, Partial())], {2}) is None
    assert region([torch.ones(2)], None) is None


def test_region_one_rank_axes_count_as_replicated(meshes) -> None:
    from keras_dtensor_fix.dtensor.planner import region

    one = meshes["1x2"]
    a = dt(one, (2, 4, 8), Shard(0), Shard(1))
    b = dt(one, (2, 4, 8), R, Shard(1))
    assert region([a, b], {2}) == (one, (Shard(0), Shard(1)))
    assert region([dt(one, (2, 4, 8), Shard(0), R)], None) == (one, (R, R))


# -- shardwise: an optimizer update --------------------------------------------


def test_shardwise(meshes) -> None:
    from keras_dtensor_fix.dtensor.planner import shardwise

    m = meshes["2x2"]
    kernel, grad = dt(m, (4, 6), R, Shard(1)), dt(m, (4, 6), R, Shard(1))
    slot, step = dt(m, (4, 6), R, Shard(1)), torch.tensor(3)
    assert shardwise([kernel, grad], [slot, step, None]) is m
    assert shardwise([kernel, torch.ones(4, 6)], [slot]) is None  # a plain value
    assert shardwise([kernel], [torch.ones(4, 6)]) is None  # a plain slot
    assert shardwise([kernel, dt(m, (4, 6), R, Partial())], []) is None
    assert shardwise([kernel], [dt(meshes["2"], (4, 6), Shard(1))]) is None
    assert shardwise([], [slot]) is None


# -- the layout planner's dataflow: the weight axes an einsum reads -----------


def test_einsum_roles_through_an_ellipsis() -> None:
    """``planning.dataflow``: an ellipsis stands for the dims its operand's letters
    leave, the weight's too; (contracted, output-only) weight axes."""
    from keras_dtensor_fix.planning.dataflow import _einsum_roles

    x, kernel = torch.ones(2, 3, 6), torch.ones(6, 8)
    assert _einsum_roles("...k,kn->...n", [x, kernel], kernel) == ((0,), (1,))
    stacked, right = torch.ones(4, 5, 6), torch.ones(6, 7)
    roles = _einsum_roles("...ij,jk->...ik", [stacked, right], stacked)
    assert roles == ((2,), (0, 1))
