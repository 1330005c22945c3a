"""``Checkpoint``: sharded checkpoints during ``fit``, resumed at the step."""

from __future__ import annotations

import os
import signal
import sys
import traceback
import warnings
from collections.abc import Iterable
from types import CodeType
from typing import Any

import keras
import numpy as np
import torch.distributed as dist

from keras_dtensor_fix.checkpoint import position
from keras_dtensor_fix.checkpoint.files import (
    CheckpointError,
    check_writable,
    read_info,
)
from keras_dtensor_fix.checkpoint.preemption import DEFAULT_TIMEOUT, Watcher
from keras_dtensor_fix.checkpoint.processes import every_process, on_first
from keras_dtensor_fix.checkpoint.sharded import PendingSave, load, save, snapshot
from keras_dtensor_fix.dtensor.world import distributed, rank
from keras_dtensor_fix.engine import targets

MonitorCallback = targets.keras_object("MonitorCallback")


class Checkpoint(MonitorCallback):
    """Save a sharded checkpoint during ``fit``; resume from it when it exists.

    The arguments as ``keras.callbacks.OrbaxCheckpoint``'s (JAX only), so a
    script moves between them by name; ``save_on_background`` copies the
    shards at the step and writes them on a thread. With ``restore``, ``fit``
    starts from the newest checkpoint: weights, optimizer, the epoch's running
    metrics and the batch after the one saved (earlier batches drawn in the
    same order and skipped).

    ``signals`` (``()``: none) preempt training: every process learns of one
    within about a second, stops after the same finished step, saves it and
    exits with 128 + the signal's number within ``preemption_timeout`` s.
    Every process runs the callback.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_best_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        initial_value_threshold: float | None = None,
        max_to_keep: int = 1,
        save_on_background: bool = True,
        *,
        optimizer: bool = True,
        metrics: bool = True,
        restore: bool = True,
        signals: Iterable[int] = (signal.SIGTERM,),
        preemption_timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__(monitor, mode, initial_value_threshold)
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(
                f"save_freq must be 'epoch' or a positive int, got {save_freq!r}"
            )
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be a positive int, got {max_to_keep!r}")
        if not preemption_timeout > 0:
            raise ValueError(
                f"preemption_timeout must be a positive number of seconds, got "
                f"{preemption_timeout!r}"
            )
        self.directory, self.save_freq = os.fspath(directory), save_freq
        self.verbose, self.save_best_only = verbose, save_best_only
        self.max_to_keep, self.save_on_background = max_to_keep, save_on_background
        self.optimizer, self.metrics, self.restore = optimizer, metrics, restore
        self._watcher = Watcher(signals, preemption_timeout)
        self._epoch, self._batch, self._restored = 0, 0, False
        self._saved_at: int | None = None  # steps done at the newest save
        self._resume: dict[str, Any] | None = None  # the epoch to resume inside
        self._begin: dict[str, Any] = {}  # what ordered this epoch's data
        self._resumed_logs: dict[str, float] = {}  # this epoch's, if resumed in it
        # After the epoch's steps, what a stop saves: (epochs done, position,
        # metric values).
        self._after: tuple[int, dict[str, Any], dict | None] | None = None
        self._pending: PendingSave | None = None
        self._group: Any = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        # An unwritable directory fails here, on every process, not mid-fit.
        every_process(
            "checking its directory", lambda: check_writable(self.directory, rank())
        )
        if self.restore and not self._restored:
            self._restored = True  # once: a second fit() goes on from where it is
            if (saved := on_first(_saved_info, self.directory)) is not None:
                self._load(self.metrics and saved.get("metrics", False))
        if self.save_on_background and distributed() and self._group is None:
            # DCP's background collectives, never interleaved with training's.
            self._group = dist.new_group(backend="gloo")
        self._watcher.start(self._stop_save, within=_fit_code(self.model))

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        with self._watcher.cond:  # a stop's save reads what changes here
            self._epoch, self._batch, self._after = epoch, 0, None
            self._resumed_logs = {}
            resume, self._resume = self._resume, None
            if resume is not None and resume["epoch"] == epoch:
                position.restore_random(resume.get("random"))
                skip = resume["batch"]
                position.plan(
                    skip, resume.get("adapter_epoch"), resume.get("random_now")
                )
                if skip:  # inside the epoch: its running metrics so far
                    variables, saved = self.model.metrics_variables, resume["metrics"]
                    for variable, value in zip(variables, saved, strict=False):
                        variable.assign(value)
                    # The epoch's logs if no batch is left (validation resets them).
                    results = self.model.get_metrics_result()
                    self._resumed_logs = {k: float(v) for k, v in results.items()}
            self._begin = {"random": position.random_state()}
            position.capture()

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if not position.consumed():
            raise CheckpointError(
                "Checkpoint cannot resume inside an epoch here: fit()'s data "
                "iterator was not reached (the plugin is off or its 'resume' "
                "family is disabled). Turn it on, or save with save_freq='epoch'"
            )
        self._watcher.begin_step()

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self._batch = batch + 1
        self._watcher.end_step()
        if self.save_freq != "epoch" and self._watcher.done % self.save_freq == 0:
            self._maybe_save(logs, at_epoch_end=False)
        self._watcher.gate()

    def on_test_begin(self, logs: dict | None = None) -> None:
        if self._after is None and self._watcher.watching():
            # Validation resets the metrics: a stop during it saves the step's.
            with self._watcher.cond:
                values = snapshot(self.model) if self.metrics else None
                self._after = (*self._position(at_epoch_end=False), values)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            # Every batch was in the checkpoint: Keras logged none of them.
            for name, value in self._resumed_logs.items():
                logs.setdefault(name, value)
        if self._watcher.watching():  # from here on a stop resumes the next epoch
            with self._watcher.cond:
                self._after = (*self._position(at_epoch_end=True), None)
        if self.save_freq == "epoch":
            self._maybe_save(logs, at_epoch_end=True)
        self._watcher.gate()

    def on_train_end(self, logs: dict | None = None) -> None:
        self._watcher.stop()
        self._finish()

    def _position(self, at_epoch_end: bool) -> tuple[int, dict[str, Any]]:
        """Epochs done, and where fit is: batches done in the epoch, what
        orders its data."""
        where = {
            "batch": 0 if at_epoch_end else self._batch,
            "batches": self._watcher.done,
            "adapter_epoch": position.adapter_epoch(at_epoch_begin=not at_epoch_end),
        }
        if at_epoch_end:  # the next epoch starts from here
            return self._epoch + 1, {**where, "random": position.random_state()}
        random_now = position.random_state()
        return self._epoch, {**where, **self._begin, "random_now": random_now}

    def _maybe_save(self, logs: dict | None, at_epoch_end: bool) -> None:
        if self.save_best_only:
            if self.monitor_op is None:
                self._set_monitor_op()
            if (current := (logs or {}).get(self.monitor)) is None:
                warnings.warn(
                    f"Checkpoint: save_best_only needs {self.monitor!r} in the "
                    f"logs (it has {sorted(logs or {})}); not saving.",
                    stacklevel=2,
                )
                return
            if not self._is_improvement(current, self.best):
                return
            self.best = current
        with self._watcher.saving():  # every process makes it, or none does
            self._finish()
            saved = self._write(
                *self._position(at_epoch_end),
                background=self.save_on_background,
                group=self._group,
            )
            self._saved_at = self._watcher.done
        if isinstance(saved, PendingSave):
            self._pending = saved
        else:
            self._note_saved(saved)

    def _note_saved(self, path: str) -> None:
        self._watcher.where = path
        if self.verbose:
            print(f"Checkpoint: saved {path}")

    def _write(self, epoch: int, where: dict[str, Any], **extra: Any) -> Any:
        return save(
            self.model,
            self.directory,
            optimizer=self.optimizer,
            metrics=self.metrics,
            keep=self.max_to_keep,
            epoch=epoch,
            position=where,
            **extra,
        )

    def _finish(self) -> None:
        """Wait for the background save, if any (every process)."""
        if self._pending is not None:
            path = self._pending.wait()
            self._pending = None  # only now: a stop's save waits for it too
            self._note_saved(path)

    def _stop_save(self, signum: int) -> str:
        """The watcher thread's save at the agreed stop; the line to exit with."""
        if self._pending is not None:  # never a half-written checkpoint
            self._watcher.where = self._pending.written()
        if self._saved_at != self._watcher.done:
            epoch, where, values = self._after or (*self._position(False), None)
            self._watcher.where = self._write(
                epoch,
                where,
                group=self._watcher.group,
                values=values,
                scope="preemption",
            )
        return (
            f"keras_dtensor_fix: {signal.Signals(signum).name}: process {rank()} "
            f"stopped after step {self._watcher.done} (epoch {self._epoch + 1}, batch "
            f"{self._batch}); saved {self._watcher.where}: the next launch resumes "
            "there"
        )

    def _load(self, metrics: bool) -> None:
        info = load(
            self.model, self.directory, optimizer=self.optimizer, metrics=metrics
        )
        self._watcher.where = info["path"]
        epoch, where = info.get("epoch"), info.get("position") or {}
        if epoch is not None:
            self.model._initial_epoch = epoch
        self._watcher.done = self._saved_at = where.get("batches", 0)
        if epoch is not None and where:
            variables = self.model.metrics_variables if metrics else []
            values = [np.array(keras.ops.convert_to_numpy(v)) for v in variables]
            self._resume = {**where, "epoch": epoch, "metrics": values}
        if self.verbose:  # a checkpoint.save() without an epoch records None
            print(
                f"Checkpoint: resumed from {info['path']} at epoch "
                f"{(epoch or 0) + 1}, batch {where.get('batch', 0) + 1}"
            )


def _fit_code(model: Any) -> CodeType | None:
    """The code of the ``fit`` call of ``model`` that is calling us, if any."""
    for frame, _ in traceback.walk_stack(sys._getframe(1)):
        if frame.f_code.co_name == "fit" and frame.f_locals.get("self") is model:
            return frame.f_code
    return None


def _saved_info(directory: str) -> dict[str, Any] | None:
    """What the complete checkpoint in ``directory`` recorded, if there is one."""
    try:
        return read_info(directory)
    except (FileNotFoundError, CheckpointError):
        return None
