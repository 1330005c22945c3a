"""Saving with one path on every process, and Keras's BackupAndRestore.

Under ModelParallel a save (``save_weights``, ``model.save``, and so
``ModelCheckpoint`` and ``BackupAndRestore``) becomes one collective step
(:func:`keras_dtensor_fix.saving.one_writer.save`); a save on some processes
only is an error naming the others, not a hang. Under other distributions
each process writes atomically. ``BackupAndRestore`` copies, records and
deletes its directory from one process, the others waiting.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from keras_dtensor_fix.checks import layout_rules
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import model_parallel
from keras_dtensor_fix.saving import one_writer

#: saving_lib function -> its name in messages.
ENTRIES = {
    "save_weights_only": "keras.saving.save_weights()",
    "save_model": "keras.saving.save_model()",
}


def _processes() -> int:
    from keras_dtensor_fix.dtensor.world import world  # torch only when saving

    return world()


def _local_path(filepath: Any) -> str | None:
    """``filepath`` as a local path, or ``None`` (a file object, a remote URL)."""
    if not isinstance(filepath, (str, os.PathLike)):
        return None
    path = str(os.fspath(filepath))
    return None if "://" in path else path


def make_wrapper(name: str):
    what = ENTRIES[name]

    def wrapper(wrapped, instance, args, kwargs):
        def save(model: Any, filepath: Any, *rest: Any, **options: Any) -> Any:
            path = _local_path(filepath)
            if path is None or _processes() == 1:
                return wrapped(model, filepath, *rest, **options)

            def write(target: str) -> None:
                wrapped(model, target, *rest, **options)

            if model_parallel() is None:
                return one_writer.write_atomically(path, write)
            values = [getattr(v, "value", v) for v in layout_rules.variables(model)]
            return one_writer.save(what, path, write, values)

        return save(*args, **kwargs)  # Keras's signature binds the arguments

    return wrapper


def _distributed_job() -> bool:
    """A Keras distribution over several processes (any: each runs callbacks)."""
    api = sys.modules.get(targets.DISTRIBUTION_API)
    return api is not None and api.distribution() is not None and _processes() > 1


def _backup(what: str, gathers: bool):
    """BackupAndRestore's ``what`` on one process, the others waiting; under
    ModelParallel they save the weights with it where it ``gathers``."""

    def wrapper(wrapped, instance, args, kwargs):
        if not _distributed_job():
            return wrapped(*args, **kwargs)

        def weights_only() -> None:  # the part of Keras's _save_model that gathers
            instance.model.save_weights(filepath=instance._weights_path, overwrite=True)

        one_writer.by_one(
            f"BackupAndRestore {what}",
            instance.backup_dir,
            lambda: wrapped(*args, **kwargs),
            weights_only if gathers and model_parallel() is not None else None,
        )

    return wrapper


def _makedirs(wrapped, instance, args, kwargs):
    """Two processes making one directory: the second finds it made."""
    try:
        return wrapped(*args, **kwargs)
    except FileExistsError:
        path = args[0] if args else kwargs.get("path")
        if _processes() > 1 and isinstance(path, (str, os.PathLike)):
            if os.path.isdir(path):
                return None
        raise


def _skipset_without_distribution(wrapped, instance, args, kwargs):
    """Keras's attribute skip-set, its throwaway Layer or Optimizer built
    without sharding (a collective that a writer saving alone would wait on)."""
    if model_parallel() is None:
        return wrapped(*args, **kwargs)
    global_state = targets.keras_object("global_state")
    name = sys.modules[targets.DISTRIBUTION_API].GLOBAL_ATTRIBUTE_NAME
    distribution = global_state.get_global_attribute(name)
    global_state.set_global_attribute(name, None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        global_state.set_global_attribute(name, distribution)


def patches(module: types.ModuleType) -> list[Patch]:
    name = module.__name__
    if targets.is_kind(name, "saving"):
        return [
            Patch(name, entry, make_wrapper(entry))
            for entry in ENTRIES
            if hasattr(module, entry)
        ] + [Patch(name, "get_attr_skipset", _skipset_without_distribution)]
    if targets.is_kind(name, "backup_and_restore"):
        if not hasattr(getattr(module, "BackupAndRestore", None), "_save_model"):
            raise LookupError("BackupAndRestore._save_model")
        return [
            Patch(name, "BackupAndRestore._save_model", _backup("backup", True)),
            Patch(name, "BackupAndRestore.on_train_end", _backup("cleanup", False)),
        ]
    return [Patch(name, "makedirs", _makedirs)]


IMPLEMENTATION = Implementation(patches)
