"""``Checkpoint`` checks at ``on_train_begin``, on every process, that it can
write its directory: an unwritable one raises ``CheckpointDirectoryError``
naming the directory, the process and the OS error, before the first step
(before this check, and in Keras's own ``ModelCheckpoint``, the first save
found it, ``save_freq`` steps in). The directory lies under a regular file:
tests run as root, whom a directory's mode bits do not stop."""

from __future__ import annotations

import json

import pytest

from support import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "ranks" / "unwritable.py"


def launch(out, who: str, nproc: int) -> list[dict]:
    proc = run_ranks(SCRIPT, str(out), who, nproc=nproc, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def assert_names(result: dict, rank: int) -> None:
    message = result["message"]
    assert f"cannot write its directory {result['directory']!r}" in message, message
    assert f"on process {rank}: NotADirectoryError" in message, message
    assert "What to do: " in message


def test_one_process_cannot_write(tmp_path) -> None:
    """The last of two processes cannot: it raises its own error, the first
    one naming it; neither trains a step."""
    first, last = launch(tmp_path, "last", 2)
    assert last["type"] == "CheckpointDirectoryError", last
    assert_names(last, 1)
    assert first["type"] == "CheckpointError", first
    assert "failed on process 1: CheckpointDirectoryError: " in first["message"]
    assert_names({**first, "directory": last["directory"]}, 1)
    assert first["batches"] == last["batches"] == 0


@pytest.mark.parametrize(("who", "expected"), [("all", 0), ("none", 2)])
def test_one_process_alone(tmp_path, who, expected) -> None:
    (result,) = launch(tmp_path, who, 1)
    assert result["batches"] == expected, result
    if who == "all":
        assert result["type"] == "CheckpointDirectoryError", result
        assert_names(result, 0)
    else:
        assert result["type"] == "no error", result
        assert result["saved"], result  # save_freq=1: its saves were written
