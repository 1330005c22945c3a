"""A checkpoint directory on disk: numbered folders, ``LATEST``, atomic commits.

A save goes to ``DIR/.partial-ckpt-N``; committing renames it to
``DIR/ckpt-N``, then replaces ``DIR/LATEST`` and removes older checkpoints
beyond ``keep`` and leftovers of interrupted saves. Standard library only.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

LATEST = "LATEST"
INFO = "keras_checkpoint.json"
PREFIX, PARTIAL = "ckpt-", ".partial-"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded."""


class CheckpointDirectoryError(CheckpointError):
    """A process cannot write the checkpoint directory."""


def check_writable(directory: str, rank: int) -> None:
    """Make ``directory`` and write a file in it, or raise
    :class:`CheckpointDirectoryError` naming it, process ``rank`` and why."""
    probe = os.path.join(directory, f".write-check-{rank}")
    try:
        os.makedirs(directory, exist_ok=True)
        open(probe, "w").close()
        os.remove(probe)
    except OSError as error:
        raise CheckpointDirectoryError(
            f"keras-dtensor-fix: Checkpoint cannot write its directory "
            f"{directory!r} on process {rank}: {type(error).__name__}: {error}. "
            "What to do: pass a directory every process can create and write "
            "(on several machines, one on a file system they share)."
        ) from error


def _write_file(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _number(entry: str) -> int | None:
    digits = entry[len(PREFIX) :]
    return int(digits) if entry.startswith(PREFIX) and digits.isdigit() else None


def _numbers(directory: str) -> list[int]:
    return sorted(n for e in os.listdir(directory) if (n := _number(e)) is not None)


def begin(directory: str) -> str:
    """Make the directory and a fresh partial folder; the new checkpoint's name."""
    os.makedirs(directory, exist_ok=True)
    name = f"{PREFIX}{max(_numbers(directory), default=0) + 1:06d}"
    partial = os.path.join(directory, PARTIAL + name)
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    return name


def commit(directory: str, name: str, info: dict, keep: int) -> None:
    partial = os.path.join(directory, PARTIAL + name)
    _write_file(os.path.join(partial, INFO), json.dumps(info, indent=1))
    os.rename(partial, os.path.join(directory, name))
    _write_file(os.path.join(directory, LATEST), name + "\n")
    # Older checkpoints and leftovers of interrupted saves go only now.
    newest = _numbers(directory)[-keep:]
    for entry in os.listdir(directory):
        if entry.startswith(PARTIAL) or _number(entry) not in (None, *newest):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


def read_info(directory: str) -> dict:
    """What the complete checkpoint ``directory`` stands for (a ``ckpt-N``
    folder, or the one ``LATEST`` names) recorded, and its ``path``."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    latest = os.path.join(directory, LATEST)
    if os.path.isfile(os.path.join(directory, ".metadata")):
        path = directory  # a ckpt-N folder itself
    elif os.path.isfile(latest):
        path = os.path.join(directory, Path(latest).read_text().strip())
    else:
        partial = sorted(e for e in os.listdir(directory) if e.startswith(PARTIAL))
        why = f" (an interrupted save left {partial[-1]})" if partial else ""
        raise FileNotFoundError(f"no complete checkpoint in {directory!r}{why}")
    for required in (".metadata", INFO):
        if not os.path.isfile(os.path.join(path, required)):
            raise CheckpointError(f"checkpoint {path} is incomplete: no {required}")
    return {**json.loads(Path(path, INFO).read_text()), "path": path}
