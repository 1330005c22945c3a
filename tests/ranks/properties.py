"""A DTensor meeting a plain full tensor in a wrapped op: the property and its cases.

``test_properties.py`` checks it in-process on a one-device mesh; run as a script
under ``torch.distributed.run --nproc_per_node=2`` it checks it on two ranks:
a fixed number of derandomized examples, so that both ranks draw the same
cases, then a JSON summary of what was covered on the last line (rank 0). It
exits non-zero on a failure on any rank.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

DTYPES = ("float32", "bfloat16", "int32")
OPS = ("add", "subtract", "multiply", "maximum", "minimum", "where")
#: Prefix of the summary line the two-rank run prints.
MARK = "COVERED "


@dataclass(frozen=True)
class Case:
    op: str
    dshape: tuple[int, ...]  # the DTensor's global shape
    pshape: tuple[int, ...]  # the plain tensor's shape (broadcasts with dshape)
    ddtype: str
    pdtype: str
    shard: int | None  # Shard(dim) of the DTensor on the mesh, None: Replicate
    swap: bool  # the plain tensor comes first
    seed: int


@st.composite
def cases(draw: st.DrawFn, world: int) -> Case:
    """A case whose shard (if any) is non-empty on each of ``world`` ranks."""
    dshape, pshape = draw(
        hnp.mutually_broadcastable_shapes(
            num_shapes=2, min_dims=0, max_dims=3, min_side=1, max_side=6
        )
    ).input_shapes
    # Uneven shards are fine for DTensor (a dim of 3 on 2 ranks: 2 and 1 rows);
    # only empty local shards are left out.
    shardable = [dim for dim, size in enumerate(dshape) if size >= world]
    return Case(
        op=draw(st.sampled_from(OPS)),
        dshape=dshape,
        pshape=pshape,
        ddtype=draw(st.sampled_from(DTYPES)),
        pdtype=draw(st.sampled_from(DTYPES)),
        shard=draw(st.sampled_from([None, *shardable])),
        swap=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _values(shape: tuple[int, ...], dtype: str, generator: Any) -> Any:
    import torch

    if dtype == "int32":
        return torch.randint(-4, 5, shape, generator=generator, dtype=torch.int32)
    values = torch.randn(shape, generator=generator) * 3
    return values.to(getattr(torch, dtype))


def _op(name: str) -> Any:
    from keras import ops

    if name == "where":
        return lambda a, b: ops.where(ops.greater(a, 0), a, b)
    return getattr(ops, name)


def check(case: Case, mesh: Any) -> None:
    """``op(DTensor, plain)`` equals, in full, ``op`` on the full plain tensors."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    generator = torch.Generator().manual_seed(case.seed)
    full = _values(case.dshape, case.ddtype, generator)
    plain = _values(case.pshape, case.pdtype, generator)
    placement = Replicate() if case.shard is None else Shard(case.shard)
    dtensor = distribute_tensor(full, mesh, [placement])
    op = _op(case.op)
    got = op(plain, dtensor) if case.swap else op(dtensor, plain)
    want = op(plain, full) if case.swap else op(full, plain)
    assert isinstance(got, DTensor), f"{case}: got a {type(got).__name__}"
    assert not isinstance(want, DTensor)
    got = got.full_tensor()
    assert got.shape == want.shape, (case, got.shape, want.shape)
    assert got.dtype == want.dtype, (case, got.dtype, want.dtype)
    if want.dtype.is_floating_point:
        torch.testing.assert_close(
            got, want, equal_nan=True, msg=lambda m: f"{case}: {m}"
        )
    else:
        assert torch.equal(got, want), (case, got, want)


def covered(seen: list[Case], world: int) -> dict[str, Any]:
    """What the drawn cases exercised, for a check that the run was not degenerate."""
    return {
        "examples": len(seen),
        "ops": sorted({c.op for c in seen}),
        "dtypes": sorted({c.ddtype for c in seen} | {c.pdtype for c in seen}),
        "sharded": sum(c.shard is not None for c in seen),
        "replicated": sum(c.shard is None for c in seen),
        "uneven": sum(
            c.shard is not None and c.dshape[c.shard] % world != 0 for c in seen
        ),
        "broadcast": sum(c.dshape != c.pshape for c in seen),
        "swapped": sum(c.swap for c in seen),
    }


def main() -> int:
    import json
    from datetime import timedelta

    import keras  # noqa: F401 - KERAS_BACKEND=torch comes from the environment
    import torch
    import torch.distributed as dist
    from hypothesis import HealthCheck, Phase, given, settings
    from torch.distributed.device_mesh import init_device_mesh

    from keras_dtensor_fix.engine import state

    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    state.note_sharding()
    examples = int(os.environ.get("PROPERTY_EXAMPLES", "60"))
    seen: list[Case] = []

    @settings(
        max_examples=examples,
        derandomize=True,  # the same cases on every rank
        database=None,
        deadline=None,
        # No shrinking: ranks that shrink differently would deadlock.
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(cases(world))
    def synced(case: Case) -> None:
        seen.append(case)
        error = None
        try:
            check(case, mesh)
        except Exception as exc:  # noqa: BLE001 - agreed on below
            error = exc
        failed = torch.tensor([int(error is not None)])
        dist.all_reduce(failed)
        if error is not None:
            raise error
        if failed.item():
            raise AssertionError(f"{case} failed on another rank")

    status = 0
    try:
        synced()
    except Exception:  # noqa: BLE001 - report and fail the process
        import traceback

        traceback.print_exc()
        status = 1
    if rank == 0:
        print(MARK + json.dumps(covered(seen, world)), flush=True)
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import leave  # skips a teardown that can abort: see leave()

    leave(main())
