"""``Checkpoint``: sharded checkpoints during ``fit``, resumed by themselves.

The arguments and their meaning are those of Keras's own
``keras.callbacks.OrbaxCheckpoint`` (sharded, asynchronous, multi-host, JAX
only; on torch it gathers everything), so a script moves between them by
name. Imported through :mod:`keras_dtensor_fix.checkpoint`.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch.distributed as dist

from keras_dtensor_fix import targets
from keras_dtensor_fix.checkpoint import (
    CheckpointError,
    PendingSave,
    _distributed,
    _from_first,
    load,
    save,
)
from keras_dtensor_fix.checkpoint_files import _resolve

MonitorCallback = targets.keras_object("MonitorCallback")


class Checkpoint(MonitorCallback):
    """Save a sharded checkpoint during ``fit``; resume from it when it exists.

    As ``keras.callbacks.OrbaxCheckpoint``: ``directory``, ``monitor``,
    ``verbose``, ``save_best_only`` (with ``mode`` and
    ``initial_value_threshold``), ``save_freq`` ("epoch" or every N
    batches), ``max_to_keep``, ``save_on_background`` (each process's shards
    are copied at the step and written by a thread while training goes on;
    the save is committed when done, or at the next save or the end of
    training). With ``restore`` (default), ``fit`` starts from the newest
    checkpoint in ``directory`` if there is one: weights, optimizer state
    and step, and the epoch to continue from, so a restarted job resumes
    with no bookkeeping in the script. Every process runs it (``fit`` does).
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
        metrics: bool = False,
        restore: bool = True,
        keep: int | None = None,
    ) -> None:
        super().__init__(monitor, mode, initial_value_threshold)
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(
                f"save_freq must be 'epoch' or a positive int, got {save_freq!r}"
            )
        max_to_keep = max_to_keep if keep is None else keep
        if not isinstance(max_to_keep, int) or max_to_keep < 1:
            raise ValueError(f"max_to_keep must be a positive int, got {max_to_keep!r}")
        self.directory, self.save_freq = os.fspath(directory), save_freq
        self.verbose, self.save_best_only = verbose, save_best_only
        self.max_to_keep, self.save_on_background = max_to_keep, save_on_background
        self.optimizer, self.metrics, self.restore = optimizer, metrics, restore
        self._epoch, self._batches, self._restored = 0, 0, False
        self._pending: PendingSave | None = None
        self._group: Any = None

    def on_train_begin(self, logs: dict | None = None) -> None:
        if self.restore and not self._restored:
            self._restored = True  # once: a second fit() goes on from where it is
            if _from_first(_complete(self.directory)):
                info = load(
                    self.model,
                    self.directory,
                    optimizer=self.optimizer,
                    metrics=self.metrics,
                )
                if info.get("epoch") is not None:
                    self.model._initial_epoch = info["epoch"]
                if self.verbose:
                    print(f"Checkpoint: resumed from {info['path']}")
        if self.save_on_background and _distributed() and self._group is None:
            # DCP's background thread runs collectives: on a group of its own,
            # never interleaved with the training step's.
            self._group = dist.new_group(backend="gloo")

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.save_freq != "epoch":
            self._batches += 1
            if self._batches % self.save_freq == 0:
                self._maybe_save(self._epoch, logs)  # epochs completed: not this one

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.save_freq == "epoch":
            self._maybe_save(epoch + 1, logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._finish()

    def _maybe_save(self, epoch: int, logs: dict | None) -> None:
        if self.save_best_only:
            if self.monitor_op is None:
                self._set_monitor_op()
            current = (logs or {}).get(self.monitor)
            if current is None:
                warnings.warn(
                    f"Checkpoint: save_best_only needs {self.monitor!r} in the "
                    f"logs (it has {sorted(logs or {})}); not saving.",
                    stacklevel=2,
                )
                return
            if not self._is_improvement(current, self.best):
                return
            self.best = current
        self._finish()
        saved = save(
            self.model,
            self.directory,
            optimizer=self.optimizer,
            metrics=self.metrics,
            keep=self.max_to_keep,
            epoch=epoch,
            background=self.save_on_background,
            group=self._group,
        )
        if isinstance(saved, PendingSave):
            self._pending = saved
        elif self.verbose:
            print(f"Checkpoint: saved {saved}")

    def _finish(self) -> None:
        """Wait for the background save, if any (every process)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            path = pending.wait()
            if self.verbose:
                print(f"Checkpoint: saved {path}")


def _complete(directory: str) -> bool:
    """Whether ``directory`` holds a complete checkpoint to resume from."""
    try:
        _resolve(directory)
    except (FileNotFoundError, CheckpointError):
        return False
    return True
