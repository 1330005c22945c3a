"""README.md's python blocks run as written: on 2 processes, and on one.

Every ```python block of README.md starts with ``# NAME.py: torchrun
--nproc_per_node=2 NAME.py``, adding ``(one process prints the same)`` where
README promises one process's results: such a block runs on 1 process too,
and what rank 0 prints must match (numbers to rtol 1e-5, the rest exactly).
A block added to README later is picked up the same way; one without the
header fails :func:`test_every_block_says_how_it_runs`. Each launch runs the
block verbatim (with the plugin on; strict mode, as every test).
"""

from __future__ import annotations

import math
import re

import pytest

from support import ROOT, run_ranks

BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
HEADER = re.compile(
    r"# (?P<name>\w+\.py): torchrun --nproc_per_node=2 (?P=name)"
    r"(?P<same> \(one process prints the same\))?$"
)
NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e-?\d+)?")
RTOL = 1e-5


def readme_blocks() -> list[str]:
    return BLOCK.findall((ROOT / "README.md").read_text())


def _cases() -> list:
    cases = []
    for code in readme_blocks():
        found = HEADER.match(code.splitlines()[0])
        if found:
            cases.append(pytest.param(code, bool(found["same"]), id=found["name"]))
    return cases


def test_every_block_says_how_it_runs() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= 2
    for code in blocks:
        assert HEADER.match(code.splitlines()[0]), code.splitlines()[0]


def _printed(proc) -> list[str]:
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, "the block printed nothing on rank 0"
    return lines


def _same(one: list[str], two: list[str]) -> bool:
    if [NUMBER.sub("#", line) for line in one] != [
        NUMBER.sub("#", line) for line in two
    ]:
        return False
    numbers = [
        (float(a), float(b))
        for x, y in zip(one, two, strict=True)
        for a, b in zip(NUMBER.findall(x), NUMBER.findall(y), strict=True)
    ]
    return all(math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12) for a, b in numbers)


@pytest.mark.parametrize(("code", "same"), _cases())
def test_readme_block_runs(tmp_path, code: str, same: bool) -> None:
    if "import keras_hub" in code:
        pytest.importorskip("keras_hub")
    name = HEADER.match(code.splitlines()[0])["name"]
    script = tmp_path / name
    script.write_text(code)
    two = _printed(run_ranks(script, nproc=2, timeout=300))
    if same:
        one = _printed(run_ranks(script, nproc=1, timeout=300))
        assert _same(one, two), (one, two)
