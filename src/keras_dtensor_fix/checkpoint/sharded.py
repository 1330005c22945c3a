"""Sharded checkpoints of Keras models with ``torch.distributed.checkpoint``.

Every process writes only its own shards of each variable (a DTensor's local
tensor; DCP writes a replicated value once), and :func:`load` reads into the
model's current placements, whatever mesh and number of processes saved it.
One process with no process group can save and load too.

Keys: ``model/<path>`` for the model's variables (``variable.path`` without
the model's own name in front, so a rebuilt model named ``sequential_1``
still matches), ``optimizer/<path>`` for the optimizer's (a slot variable
named after its model variable gets that variable's key, e.g.
``optimizer/dense_1/kernel/momentum``; the iteration count is
``optimizer/iteration``) and, when asked for, ``metrics/<path>``.

On disk a save is atomic: each one goes to ``DIR/.partial-ckpt-N``, which the
first process renames to ``DIR/ckpt-N`` once every process has written its
shards, and only then points ``DIR/LATEST`` (replaced atomically) at it. A
save that dies halfway leaves the previous checkpoint in place.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from typing import Any

import keras
import torch
import torch.distributed.checkpoint as dcp

from keras_dtensor_fix.checkpoint.files import (
    INFO,
    PARTIAL,
    CheckpointError,
    begin,
    commit,
    resolve,
)
from keras_dtensor_fix.checkpoint.processes import every_process, on_first
from keras_dtensor_fix.dtensor.world import distributed, rank, world

__all__ = [
    "CheckpointError",
    "CheckpointMismatchError",
    "PendingSave",
    "load",
    "save",
    "snapshot",
]

FORMAT = 1
#: How many names a mismatch error lists per kind before "... and N more".
SHOW = 10


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint's variables do not fit the model (names, shapes)."""

    def __init__(
        self,
        path: str,
        missing: list[str],
        unexpected: list[str],
        shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]],
    ) -> None:
        self.missing, self.unexpected, self.shapes = missing, unexpected, shapes
        lines = [f"checkpoint {path} does not fit this model:"]
        if missing:
            lines.append(f"missing from the checkpoint: {_names(missing)}")
        if unexpected:
            lines.append(
                f"in the checkpoint but not in the model: {_names(unexpected)}"
            )
        if shapes:
            shown = [f"{k} (saved {s}, model {m})" for k, (s, m) in shapes.items()]
            lines.append(f"shape mismatch: {_names(shown)}")
        super().__init__("\n".join(lines))


def _names(items: list[str]) -> str:
    more = f", ... and {len(items) - SHOW} more" if len(items) > SHOW else ""
    return ", ".join(items[:SHOW]) + more


# ---------------------------------------------------------------- state


def _tensor(variable: Any) -> torch.Tensor:
    """The variable's storage, detached: DCP reads and writes it in place.

    ``_value``, not ``value``: inside an autocast scope ``value`` is a copy.
    A DTensor's ``detach`` keeps its local tensor's storage.
    """
    value = getattr(variable, "_value", None)
    if value is None:
        raise CheckpointError(f"variable {variable.path} is not initialized")
    return value.detach()


def _strip(path: str, name: str) -> str:
    return path[len(name) + 1 :] if path.startswith(name + "/") else path


def _seed_states(layer: Any, prefix: str, found: dict[int, str]) -> dict[int, str]:
    """Key each seed generator's state by its layer's name path.

    Its own path is ``seed_generator_<N>/...``, numbered in creation order
    across the process, and the user cannot name it; a layer can be named.
    """
    for i, generator in enumerate(getattr(layer, "_seed_generators", ())):
        key = f"{prefix}seed_generator_state" + (f"_{i}" if i else "")
        found.setdefault(id(generator.state), key)
    for sub in layer._flatten_layers(include_self=False, recursive=False):
        _seed_states(sub, f"{prefix}{sub.name}/", found)
    return found


def _model_keys(model: Any) -> list[tuple[str, Any]]:
    seeds = _seed_states(model, "", {})
    return [
        ("model/" + seeds.get(id(v), _strip(v.path, model.name)), v)
        for v in model.variables
    ]


def _optimizer_keys(model: Any, optimizer: Any) -> list[tuple[str, Any]]:
    # Keras names a slot variable "<reference path with _ for />_<slot>";
    # longest first, so "dense_1_kernel" wins over "dense_1".
    refs = sorted(
        (
            (v.path.replace("/", "_") + "_", _strip(v.path, model.name))
            for v in model.trainable_variables
        ),
        key=lambda item: -len(item[0]),
    )
    keys = []
    for variable in optimizer.variables:
        head, _, last = _strip(variable.path, optimizer.name).rpartition("/")
        for flat, key in refs:
            if last.startswith(flat) and len(last) > len(flat):
                last = f"{key}/{last[len(flat) :]}"
                break
        keys.append(("optimizer/" + (f"{head}/{last}" if head else last), variable))
    return keys


def _variables(model: Any, optimizer: bool, metrics: bool) -> dict[str, Any]:
    if not model.built or not model.variables:
        raise CheckpointError(
            f"model {model.name!r} has no variables yet: build it first "
            "(call it on a batch, or model.build(input_shape))"
        )
    groups = [_model_keys(model)]
    if optimizer:
        opt = getattr(model, "optimizer", None)
        if opt is None:
            raise CheckpointError(
                f"model {model.name!r} has no optimizer: compile it first, "
                "or pass optimizer=False"
            )
        if not opt.built:
            opt.build(model.trainable_variables)
        groups.append(_optimizer_keys(model, opt))
    if metrics:
        groups.append([(f"metrics/{v.path}", v) for v in model.metrics_variables])
    found: dict[str, Any] = {}
    for group in groups:
        for key, variable in group:
            if key in found:
                raise CheckpointError(
                    f"two variables share the checkpoint key {key!r}: "
                    f"{found[key].path} and {variable.path} (give the layers "
                    "distinct names)"
                )
            found[key] = variable
    return found


@contextlib.contextmanager
def _dcp_call():
    """Silence DCP's warning that no process group means one process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ---------------------------------------------------------------- API


def save(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    optimizer: bool = True,
    metrics: bool = False,
    keep: int = 1,
    epoch: int | None = None,
    position: dict[str, Any] | None = None,
    background: bool = False,
    group: Any = None,
    values: dict[str, torch.Tensor] | None = None,
    scope: str = "checkpoint",
) -> str | PendingSave:
    """Save ``model`` (and its optimizer) to ``directory``; every process calls it.

    Each process writes its own shards; nothing is gathered. ``keep`` is how
    many checkpoints stay in ``directory``; ``epoch`` (epochs completed) is
    recorded for :func:`load` to return, and so is ``position`` (where
    ``fit`` is inside an epoch: the ``Checkpoint`` callback's). Returns the
    new checkpoint's folder; with ``background`` a :class:`PendingSave`
    instead: the shards are copied now and written by a thread (its
    collectives on ``group``, a process group apart from training's, e.g.
    ``dist.new_group(backend="gloo")``; a save from a thread of the caller's
    passes its own ``group`` and ``scope``, the name its store calls meet
    under). ``values``: tensors saved for some keys instead of the
    variables' own (metrics as they were before validation reset them).
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    directory = os.fspath(directory)
    variables = _variables(model, optimizer, metrics)
    state = {key: _tensor(v) for key, v in variables.items()}
    state.update({k: v for k, v in (values or {}).items() if k in state})
    name = on_first(begin, directory, scope=scope)
    opt, step = getattr(model, "optimizer", None), None
    if opt is not None:  # the local value: it is replicated, no collective
        iterations = _tensor(opt.iterations)
        step = int(getattr(iterations, "_local_tensor", iterations))
    info = {
        "format": FORMAT,
        "epoch": epoch,
        "step": step,
        "processes": world(),
        "optimizer": optimizer,
        "metrics": metrics,
        **({"position": position} if position is not None else {}),
    }
    where = os.path.join(directory, PARTIAL + name)
    if background:
        with _dcp_call():
            future = dcp.async_save(
                state,
                checkpoint_id=where,
                process_group=group,
                no_dist=not distributed(),
            )
        return PendingSave(future, directory, name, info, keep)
    with _dcp_call():
        dcp.save(
            state,
            checkpoint_id=where,
            process_group=group,
            no_dist=not distributed(),
        )
    # dcp.save returns once every process's shards and the metadata are
    # written, so the first process may rename now.
    on_first(commit, directory, name, info, keep, scope=scope)
    return os.path.join(directory, name)


class PendingSave:
    """A checkpoint being written in the background.

    The first process commits it (rename, ``LATEST``) as soon as its write
    ends: DCP's coordinator finishes only once every process has written its
    shards. :meth:`wait` (every process, in step) returns the folder or
    raises what failed anywhere.
    """

    def __init__(self, future: Any, directory: str, name: str, info: dict, keep: int):
        self.path = os.path.join(directory, name)
        self._error: BaseException | None = None
        self._future = getattr(future, "upload_completion", future)
        self._committed = threading.Event()
        if rank() == 0:
            self._future.add_done_callback(
                lambda done: self._commit(done, directory, name, info, keep)
            )
        else:
            self._committed.set()

    def _commit(self, done: Any, directory: str, name: str, info: dict, keep: int):
        try:
            if done.exception() is None:
                commit(directory, name, info, keep)
        except Exception as exc:  # noqa: BLE001 - raised by wait()
            self._error = exc
        finally:
            self._committed.set()

    def wait(self) -> str:
        """Block until written and committed, on every process."""
        self._committed.wait()

        def check() -> None:
            error = self._future.exception() or self._error
            if error is not None:
                raise CheckpointError(
                    f"background save of {self.path} failed: {error!r}"
                ) from error

        every_process("background save", check)
        return self.path

    def written(self) -> str:
        """Block until this process's part is written and committed; its
        folder, or raise this process's error (no exchange: for a thread
        other than the one that saves in step with the other processes)."""
        self._committed.wait()
        error = self._future.exception() or self._error
        if error is not None:
            raise CheckpointError(f"background save of {self.path} failed: {error!r}")
        return self.path


def snapshot(model: keras.Model) -> dict[str, torch.Tensor]:
    """Copies of the metric variables' values, keyed as :func:`save` keys them."""
    return {f"metrics/{v.path}": _tensor(v).clone() for v in model.metrics_variables}


def load(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    optimizer: bool = True,
    metrics: bool = False,
) -> dict[str, Any]:
    """Load the newest checkpoint in ``directory`` into ``model`` in place.

    Every process reads what its own shards need, into the variables'
    current placements. Checks names and shapes first and raises
    :class:`CheckpointMismatchError` naming what does not fit. Returns what
    :func:`save` recorded (``epoch``, ``step``, ``processes``, ``path``).
    """
    path = resolve(os.fspath(directory))
    with open(os.path.join(path, INFO)) as handle:
        info = json.load(handle)
    if optimizer and not info.get("optimizer", True):
        raise CheckpointError(
            f"checkpoint {path} was saved without the optimizer: pass optimizer=False"
        )
    if metrics and not info.get("metrics", False):
        raise CheckpointError(
            f"checkpoint {path} was saved without metrics: pass metrics=False"
        )
    variables = _variables(model, optimizer, metrics)
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    groups = {"model", *("optimizer",) * optimizer, *("metrics",) * metrics}
    wanted = {k: v for k, v in saved.items() if k.split("/", 1)[0] in groups}
    shapes = {
        key: (tuple(wanted[key].size), tuple(v.shape))
        for key, v in variables.items()
        if key in wanted and tuple(wanted[key].size) != tuple(v.shape)
    }
    missing = sorted(set(variables) - set(wanted))
    unexpected = sorted(set(wanted) - set(variables))
    if missing or unexpected or shapes:
        raise CheckpointMismatchError(path, missing, unexpected, shapes)
    state = {key: _tensor(v) for key, v in variables.items()}
    with torch.no_grad(), _dcp_call():
        dcp.load(state, checkpoint_id=path, no_dist=not distributed())
    return {**info, "path": path}
