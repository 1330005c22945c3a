"""One path, many processes: each file written once, atomically.

Every process of a job calls ``save_weights("best.weights.h5")`` with the
same path, and under a sharded distribution the save is a collective (each
sharded variable gathered). :func:`save` makes it one collective step, so a
failure anywhere is an error everywhere.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Iterable
from typing import Any

from keras_dtensor_fix.engine import config
from keras_dtensor_fix.saving import handshake

HINT = (
    "Under ModelParallel a save gathers the sharded variables, so every process "
    "must call it, with the same path (one process writes it) or a path of its "
    "own; or save the shards with keras_dtensor_fix.checkpoint on every process."
)

_local = threading.local()


class SaveError(OSError):
    """A save that every process made failed on one of them."""


def gathered(value: Any) -> Any | None:
    """The full value the running save gathered for DTensor ``value``.

    ``None`` outside a save or for a replicated value; a sharded value the
    save did not gather raises (the others will join no collective now).
    """
    if (cache := getattr(_local, "cache", None)) is None:
        return None
    found = cache.get(id(value))
    if found is None and not all(p.is_replicate() for p in value.placements):
        raise SaveError(
            "keras-dtensor-fix: this save reached a sharded value that is not a "
            f"variable of the model or its optimizer (shape {tuple(value.shape)}, "
            f"placements {value.placements}); it cannot be gathered while the "
            "other processes wait. Save it with keras_dtensor_fix.checkpoint."
        )
    return found


def _gather(values: Iterable[Any], keep: bool) -> dict[int, Any]:
    """Full values of the sharded DTensors in ``values``, by id, on the host;
    a collective on every process, kept by the writer (``keep``) only."""
    from torch.distributed.tensor import DTensor

    cache: dict[int, Any] = {}
    for key, value in {id(v): v for v in values if isinstance(v, DTensor)}.items():
        if all(p.is_replicate() for p in value.placements):
            continue
        full = value.detach().full_tensor()
        if keep:  # to the host at once: one variable at a time on the device
            cache[key] = full.cpu()
        del full
    return cache


def write_atomically(path: str, write: Callable[[str], None]) -> None:
    """``write(target)`` into a fresh directory beside ``path``, then moved
    in (everything it made; the named file last)."""
    path = os.path.abspath(path)
    parent, base = os.path.split(path)
    staging = tempfile.mkdtemp(prefix=f".{base}.", suffix=".partial", dir=parent)
    try:
        write(os.path.join(staging, base))
        for name in sorted(os.listdir(staging), key=lambda n: n == base):
            source, target = os.path.join(staging, name), os.path.join(parent, name)
            if os.path.isdir(source) and os.path.isdir(target):
                shutil.rmtree(target)
            os.replace(source, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def writer(what: str, path: str) -> bool:
    """Whether this process writes ``path``: the lowest rank passing it on
    this host (exchanged with every process)."""
    from keras_dtensor_fix.dtensor.world import rank

    place = f"{socket.gethostname()}\0{os.path.abspath(path)}"
    return handshake.exchange(what, place, HINT).index(place) == rank()


def by_one(
    what: str,
    path: str,
    run: Callable[[], None],
    elsewhere: Callable[[], None] | None = None,
) -> None:
    """``run()`` on the process that writes ``path``, ``elsewhere()`` on the
    others; every process calls it, and a failure anywhere raises
    :class:`SaveError` everywhere, naming process and path."""
    hint = (
        f"A process did not finish its part of a save of {path} (it may have "
        f"died while writing it). Raise {config.ENV_SAVE_TIMEOUT} for larger models."
    )
    handshake.one_acts(
        what,
        run if writer(what, path) else elsewhere,
        hint,
        lambda failed: SaveError(
            f"keras-dtensor-fix: a save failed on {failed}. The file there, if "
            "any, is the one saved before (nothing half written replaces it). "
            "Fix the path (it must be writable by that process, on a disk with "
            "room) and save again."
        ),
        note=f" writing {path}",
    )


def save(what: str, path: str, write: Callable[[str], None], values: Iterable) -> None:
    """A save every process makes: gather ``values`` (in the same order
    everywhere), one writer per path, report."""

    def gather_and_write() -> None:
        _local.cache = _gather(values, keep=True)  # what gathered() hands on
        try:
            write_atomically(path, write)
        finally:
            _local.cache = None

    by_one(what, path, gather_and_write, lambda: _gather(values, keep=False))
