""":func:`save` and :func:`load`: each process its own shards, through DCP.

Keys: ``model/<path>`` (the path without the model's name, so a rebuilt
``sequential_1`` still matches), ``optimizer/<path>`` (a slot variable under
its model variable's key, e.g. ``optimizer/dense_1/kernel/momentum``) and
``metrics/<path>``. A save is committed atomically by ``files``.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from typing import Any

import keras
import torch
import torch.distributed.checkpoint as dcp

from keras_dtensor_fix.checkpoint.files import (
    PARTIAL,
    CheckpointError,
    begin,
    commit,
    read_info,
)
from keras_dtensor_fix.checkpoint.processes import every_process, on_first
from keras_dtensor_fix.dtensor.world import distributed, rank, world

FORMAT = 1
SHOW = 10  # names a mismatch error lists per kind


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
        kinds = {
            "missing from the checkpoint": missing,
            "in the checkpoint but not in the model": unexpected,
            "shape mismatch": [
                f"{k} (saved {s}, model {m})" for k, (s, m) in shapes.items()
            ],
        }
        lines = [f"checkpoint {path} does not fit this model:"]
        for kind, names in kinds.items():
            more = f", ... and {len(names) - SHOW} more" if len(names) > SHOW else ""
            if names:
                lines.append(f"{kind}: {', '.join(names[:SHOW])}{more}")
        super().__init__("\n".join(lines))


def _tensor(variable: Any) -> torch.Tensor:
    """The variable's storage, which DCP writes in place (``value`` is a
    copy under autocast)."""
    if (value := getattr(variable, "_value", None)) is None:
        raise CheckpointError(f"variable {variable.path} is not initialized")
    return value.detach()


def _strip(path: str, name: str) -> str:
    return path[len(name) + 1 :] if path.startswith(name + "/") else path


def _seed_states(layer: Any, prefix: str, found: dict[int, str]) -> dict[int, str]:
    """Seed generator states keyed by their layer's path (their own
    ``seed_generator_<N>`` counts across the process)."""
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
    # Slots are named "<path with _ for />_<slot>"; longest prefix first.
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
        if (opt := getattr(model, "optimizer", None)) is None:
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
    """Without DCP's warning that no process group means one process."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


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

    ``keep``: checkpoints kept; ``epoch`` (completed) and ``position`` are
    recorded for :func:`load`. Returns the new folder, or with ``background``
    a :class:`PendingSave` (shards copied now, written by a thread whose
    collectives use ``group``, a process group apart from training's).
    ``scope`` names the store calls of a save from another thread; ``values``
    replace some keys' tensors (metrics from before validation reset them).
    """
    if keep < 1:
        raise ValueError(f"keep must be at least 1, got {keep}")
    directory = os.fspath(directory)
    variables = _variables(model, optimizer, metrics)
    state = {key: _tensor(v) for key, v in variables.items()}
    state.update({k: v for k, v in (values or {}).items() if k in state})
    name = on_first(begin, directory, scope=scope)
    opt, step = getattr(model, "optimizer", None), None
    if opt is not None:  # replicated: the local value, no collective
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
    with _dcp_call():
        written = (dcp.async_save if background else dcp.save)(
            state,
            checkpoint_id=os.path.join(directory, PARTIAL + name),
            process_group=group,
            no_dist=not distributed(),
        )
    if background:
        return PendingSave(written, directory, name, info, keep)
    # dcp.save returns once every shard and the metadata are written.
    on_first(commit, directory, name, info, keep, scope=scope)
    return os.path.join(directory, name)


class PendingSave:
    """A checkpoint being written in the background; the first process
    commits it when DCP's coordinator (last to finish) is done."""

    def __init__(self, future: Any, directory: str, name: str, info: dict, keep: int):
        self.path = os.path.join(directory, name)
        self._error: BaseException | None = None
        self._future = getattr(future, "upload_completion", future)
        self._committed = threading.Event()
        if rank() != 0:
            self._committed.set()
            return

        def done(finished: Any) -> None:
            try:
                if finished.exception() is None:
                    commit(directory, name, info, keep)
            except Exception as exc:  # noqa: BLE001 - raised by wait()
                self._error = exc
            finally:
                self._committed.set()

        self._future.add_done_callback(done)

    def wait(self) -> str:
        """Block until written and committed on every process; the folder."""
        every_process("background save", self.written)
        return self.path

    def written(self) -> str:
        """Block until this process's part is committed (no exchange); the
        folder, or this process's error."""
        self._committed.wait()
        if (error := self._future.exception() or self._error) is not None:
            raise CheckpointError(
                f"background save of {self.path} failed: {error!r}"
            ) from error
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
    """Load the newest checkpoint in ``directory`` into ``model``'s placements.

    Raises :class:`CheckpointMismatchError` naming names and shapes that do
    not fit. Returns what :func:`save` recorded, and ``path``.
    """
    info = read_info(os.fspath(directory))
    path = info["path"]
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
    return info
