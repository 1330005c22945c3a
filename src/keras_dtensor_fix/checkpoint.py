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
import shutil
import warnings
from collections.abc import Iterable
from typing import Any

import keras
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["Checkpoint", "CheckpointError", "CheckpointMismatchError", "load", "save"]

FORMAT = 1
LATEST = "LATEST"
INFO = "keras_checkpoint.json"
PREFIX, PARTIAL = "ckpt-", ".partial-"
#: How many names a mismatch error lists per kind before "... and N more".
SHOW = 10


class CheckpointError(RuntimeError):
    """A checkpoint cannot be saved or loaded."""


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


# ---------------------------------------------------------------- processes


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _dcp_call():
    """Silence DCP's warning that no process group means one process: we mean it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _from_first(value: Any) -> Any:
    """``value`` as the first process has it (every process calls this)."""
    if not _distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _on_first(fn, *args: Any) -> Any:
    """Run ``fn`` on the first process; all return its result or raise its error.

    The other processes wait for it: a broadcast is a barrier that carries
    the first process's failure too, so none hangs on an error.
    """
    result, error = None, None
    if _rank() == 0:
        try:
            result = fn(*args)
        except Exception as exc:  # noqa: BLE001 - re-raised on every process
            error = exc
    outcome = _from_first((result, None if error is None else repr(error)))
    if error is not None:
        raise error
    if outcome[1] is not None:
        raise CheckpointError(f"the first process failed: {outcome[1]}")
    return outcome[0]


# ---------------------------------------------------------------- files


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: str, text: str) -> None:
    """Write ``path`` atomically (a temporary file, then ``os.replace``)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(os.path.dirname(path) or ".")


def _numbers(directory: str) -> Iterable[int]:
    for name in os.listdir(directory):
        if name.startswith(PREFIX) and name[len(PREFIX) :].isdigit():
            yield int(name[len(PREFIX) :])


def _begin(directory: str) -> str:
    """Make the directory and a fresh partial folder; the new checkpoint's name."""
    os.makedirs(directory, exist_ok=True)
    name = f"{PREFIX}{max(_numbers(directory), default=0) + 1:06d}"
    partial = os.path.join(directory, PARTIAL + name)
    shutil.rmtree(partial, ignore_errors=True)
    os.makedirs(partial)
    return name


def _commit(directory: str, name: str, info: dict, keep: int) -> None:
    partial = os.path.join(directory, PARTIAL + name)
    _write_file(os.path.join(partial, INFO), json.dumps(info, indent=1))
    os.rename(partial, os.path.join(directory, name))
    _write_file(os.path.join(directory, LATEST), name + "\n")
    # Older checkpoints and leftovers of interrupted saves go only now.
    newest = sorted(_numbers(directory))[-keep:]
    for entry in os.listdir(directory):
        stale = entry.startswith(PARTIAL) or (
            entry.startswith(PREFIX)
            and entry[len(PREFIX) :].isdigit()
            and int(entry[len(PREFIX) :]) not in newest
            and entry != name
        )
        if stale:
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)


def _resolve(directory: str) -> str:
    """The complete checkpoint ``directory`` stands for, or a clear error."""
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
    latest = os.path.join(directory, LATEST)
    if os.path.isfile(os.path.join(directory, ".metadata")):
        path = directory  # a ckpt-N folder itself
    elif os.path.isfile(latest):
        with open(latest) as handle:
            path = os.path.join(directory, handle.read().strip())
    else:
        partial = sorted(e for e in os.listdir(directory) if e.startswith(PARTIAL))
        why = f" (an interrupted save left {partial[-1]})" if partial else ""
        raise FileNotFoundError(f"no complete checkpoint in {directory!r}{why}")
    for required in (".metadata", INFO):
        if not os.path.isfile(os.path.join(path, required)):
            raise CheckpointError(f"checkpoint {path} is incomplete: no {required}")
    return path


# ---------------------------------------------------------------- API


def save(
    model: keras.Model,
    directory: str | os.PathLike,
    *,
    optimizer: bool = True,
    metrics: bool = False,
    keep: int = 1,
    epoch: int | None = None,
) -> str:
    """Save ``model`` (and its optimizer) to ``directory``; every process calls it.

    Each process writes its own shards; nothing is gathered. ``keep`` is how
    many checkpoints stay in ``directory``; ``epoch`` (epochs completed) is
    recorded for :func:`load` to return. Returns the new checkpoint's folder.
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    directory = os.fspath(directory)
    variables = _variables(model, optimizer, metrics)
    state = {key: _tensor(v) for key, v in variables.items()}
    name = _on_first(_begin, directory)
    with _dcp_call():
        dcp.save(
            state,
            checkpoint_id=os.path.join(directory, PARTIAL + name),
            no_dist=not _distributed(),
        )
    opt, step = getattr(model, "optimizer", None), None
    if opt is not None:  # the local value: it is replicated, no collective
        iterations = _tensor(opt.iterations)
        step = int(getattr(iterations, "_local_tensor", iterations))
    info = {
        "format": FORMAT,
        "epoch": epoch,
        "step": step,
        "processes": dist.get_world_size() if _distributed() else 1,
        "optimizer": optimizer,
        "metrics": metrics,
    }
    # dcp.save returns once every process's shards and the metadata are
    # written, so the first process may rename now.
    _on_first(_commit, directory, name, info, keep)
    return os.path.join(directory, name)


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
    path = _resolve(os.fspath(directory))
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
        dcp.load(state, checkpoint_id=path, no_dist=not _distributed())
    return {**info, "path": path}


class Checkpoint(keras.callbacks.Callback):
    """Save a sharded checkpoint during ``fit``: every epoch or every N batches.

    Every process must run the callback (``fit`` does). Resume with
    ``info = load(model, directory)`` and ``fit(..., initial_epoch=info["epoch"])``.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        save_freq: str | int = "epoch",
        *,
        optimizer: bool = True,
        metrics: bool = False,
        keep: int = 1,
    ) -> None:
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(
                f"save_freq must be 'epoch' or a positive int, got {save_freq!r}"
            )
        self.directory, self.save_freq = os.fspath(directory), save_freq
        self.optimizer, self.metrics, self.keep = optimizer, metrics, keep
        self._epoch, self._batches = 0, 0

    def _save(self, epoch: int) -> None:
        save(
            self.model,
            self.directory,
            optimizer=self.optimizer,
            metrics=self.metrics,
            keep=self.keep,
            epoch=epoch,
        )

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.save_freq != "epoch":
            self._batches += 1
            if self._batches % self.save_freq == 0:
                self._save(self._epoch)  # epochs completed: not this one

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            self._save(epoch + 1)
