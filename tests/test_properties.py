"""Property: a wrapped op on (DTensor, plain full tensor) computes the plain result.

For random shapes (with broadcasting either way), dtypes (float32, bfloat16,
int32, mixed), placements (Replicate, Shard(d), uneven shards on two ranks)
and operand order, ``keras.ops.<op>`` on a DTensor and a plain tensor holding
the full value returns a DTensor whose ``full_tensor()`` equals the op on the
full plain tensors: exactly for integers, ``assert_close`` for floats. Once
in-process on a one-device mesh, once on two ranks.
"""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings

from ranks.properties import DTYPES, MARK, OPS, Case, cases, check
from support import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "ranks" / "properties.py"
TWO_RANK_EXAMPLES = 150


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(case=cases(world=1))
# A plain 0-d tensor (not promoted: a scalar) and a plain operand that
# broadcasts the sharded DTensor up.
@example(case=Case("add", (4, 6), (), "float32", "int32", 1, False, 1))
@example(case=Case("multiply", (1, 6), (3, 1, 6), "bfloat16", "bfloat16", 1, True, 2))
@example(case=Case("where", (2, 3), (3,), "int32", "float32", 0, False, 3))
def test_one_device_mesh(mesh1, case: Case) -> None:
    check(case, mesh1)


def test_two_ranks() -> None:
    proc = run_ranks(SCRIPT, env={"PROPERTY_EXAMPLES": str(TWO_RANK_EXAMPLES)})
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith(MARK)]
    summary = json.loads(line[len(MARK) :])
    # Both ranks ran every example, and the examples were not degenerate.
    assert summary["examples"] == TWO_RANK_EXAMPLES, summary
    assert summary["ops"] == sorted(OPS) and summary["dtypes"] == sorted(DTYPES)
    for key in ("sharded", "replicated", "uneven", "broadcast", "swapped"):
        assert summary[key] >= 3, summary
