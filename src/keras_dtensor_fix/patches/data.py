"""Batches into ModelParallel: ``distribute_data_input`` and the early trainer.

* ``distribute_data_input`` is replaced: it accepts both historical signatures
  (with and without ``batch_dim_name``), walks nested structures itself, and
  keeps data on its device (upstream copies CUDA batches to the CPU and back).
* A ModelParallel epoch iterates the ``DataLoader`` one process iterates, once
  the processes agree on what each feeds it (:func:`_one_process_batches`,
  :mod:`keras_dtensor_fix.checks.feeds`).
* On nightlies whose trainer never distributes the batch (up to ~2026-09), the
  train/test/predict steps distribute plain batches as per-process shards, and
  ``predict`` returns each process's rows with the model axes gathered.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

from keras_dtensor_fix.checks import feeds
from keras_dtensor_fix.dtensor import gather_non_batch_axes, same_mesh, wrap_local
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require
from keras_dtensor_fix.engine.state import model_parallel, note_sharding
from keras_dtensor_fix.ops.values import walk


def _placements(layout: Any) -> tuple[Any, tuple]:
    """The torch mesh and batch placements of a Keras or backend layout.

    Keras builds a new ``TensorLayout`` for every batch; its conversion is
    remembered by axes and mesh.
    """
    if not isinstance(layout, targets.keras_object("TensorLayout")):
        return _torch_placements(layout)
    key = (tuple(layout.axes), layout.device_mesh)
    if key not in _LAYOUTS:
        if len(_LAYOUTS) >= 64:
            _LAYOUTS.clear()
        backend = sys.modules[targets.DISTRIBUTION_LIB]._to_backend_layout(layout)
        _LAYOUTS[key] = _torch_placements(backend)
    return _LAYOUTS[key]


_LAYOUTS: dict[tuple, tuple] = {}


def _distribute_leaf(value: Any, layout: Any) -> Any:
    if value is None or layout is None:
        return value
    mesh, placements = _placements(layout)
    if isinstance(value, DTensor):
        if same_mesh(value.device_mesh, mesh) and tuple(value.placements) == placements:
            return value
        return value.redistribute(mesh, placements)
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    note_sharding()
    dtensor = wrap_local(value, mesh, placements)
    # A compiled step that recompiles (a guard on optimizer state, say) would
    # otherwise turn the batch size symbolic, and DTensor sharding propagation
    # fails on symbolic shard sizes (torch 2.13; pytorch/pytorch#152963).
    # Every batch is marked, eager steps' too (about 3 us): ``train_on_batch``
    # distributes its first batch before it builds the compiled step, and a
    # mark its trace did not see fails a guard at the next call (a recompile).
    torch._dynamo.mark_static(dtensor)
    torch._dynamo.mark_static(dtensor._local_tensor)
    return dtensor


def _torch_placements(layout: Any) -> tuple[Any, tuple]:
    """A backend layout's mesh and placements, Replicate on mesh axes of size 1.

    Sharding over a single process changes nothing but makes every reduction
    over the batch (loss, gradients) a Partial on that axis: a collective per
    value, each step, on a one-process group.
    """
    mesh = layout.device_mesh
    return mesh, tuple(
        Replicate() if size == 1 else placement
        for size, placement in zip(mesh.shape, layout.placements, strict=True)
    )


def distribute_data_input(
    per_process_batch: Any, layout: Any, batch_dim_name: str | None = None
) -> Any:
    """Make a DTensor of each process's batch (nested structures too).

    ``batch_dim_name`` is accepted for the JAX-style signature; the layout
    already names the batch axis.
    """
    if layout is None:
        return per_process_batch
    return walk(per_process_batch, layout, _distribute_leaf)


def _replace_distribute_data_input(wrapped, instance, args, kwargs):
    return distribute_data_input(*args, **kwargs)


def _step_layouts(dist: Any, data: Any) -> Any:
    def one(value: Any, _layout: Any) -> Any:
        shape = getattr(value, "shape", None)
        return None if shape is None else dist.get_data_layout(tuple(shape))

    return walk(data, None, one)


def _distribute_step_data(wrapped, instance, args, kwargs):
    dist = model_parallel()
    if dist is not None and args:
        data = args[0]
        args = (distribute_data_input(data, _step_layouts(dist, data)),) + args[1:]
    return wrapped(*args, **kwargs)


def _predict_step(wrapped, instance, args, kwargs):
    dist = model_parallel()
    outputs = _distribute_step_data(wrapped, instance, args, kwargs)
    if dist is None:
        return outputs
    return walk(
        outputs, None, lambda v, _: gather_non_batch_axes(v, dist.batch_dim_name)
    )


def _one_process_batches(wrapped, instance, args, kwargs):
    """``TorchEpochIterator._get_iterator`` under ModelParallel: the batches
    one process iterates, each distributed as Keras distributes it.

    Keras's ModelParallel epochs walk numpy batches, permuted by numpy and
    drawing nothing; one process iterates the adapter's ``DataLoader``
    (``shuffle=True`` permutes with a torch generator, each ``iter()`` draws a
    seed from torch's global generator, which unseeded dropout reads). The
    loader is iterated here, not at the first batch, so its draw comes where
    one process's does. The processes agree on the epoch's data here, where
    Keras makes the iterator: under ``steps_per_epoch`` Keras ends an epoch
    without a fetch when a process's data runs out, and the iterator it makes
    then meets the others' next exchange (both raise).
    """
    dist = model_parallel()
    if dist is None:
        return wrapped(*args, **kwargs)
    steps = getattr(instance, "steps_per_epoch", None)
    each = feeds.before_epoch(instance.data_adapter, steps)
    try:
        loader = instance.data_adapter.get_torch_dataloader()
    except NotImplementedError:  # an adapter without one: Keras's numpy batches
        batches = wrapped(*args, **kwargs)
        return feeds.per_batch(iter(batches)) if each else batches
    batches = iter(loader)
    return _distributed(feeds.per_batch(batches) if each else batches, dist)


def _distributed(batches: Any, dist: Any) -> Any:
    layouts = None  # one set per epoch, from the first batch, as Keras makes them
    for data in batches:
        if layouts is None:
            layouts = _step_layouts(dist, data)
        yield distribute_data_input(data, layouts)


def patches(module: types.ModuleType) -> list[Patch]:
    name = module.__name__
    if targets.is_kind(name, "distribution_lib"):
        why = "this Keras has no torch data distribution"
        attribute = require(module, "distribute_data_input", why)
        also_in = targets.ALIASES["trainer"]
        return [Patch(name, attribute, _replace_distribute_data_input, also_in)]
    if targets.trainer_distributes_batches(module):
        # This trainer distributes batches itself; its ModelParallel epochs
        # walk numpy.
        iterator = getattr(module, "TorchEpochIterator", None)
        if iterator is None or not hasattr(iterator, "_get_distributed_iterator"):
            return []
        return [Patch(name, "TorchEpochIterator._get_iterator", _one_process_batches)]
    cls = targets.trainer_class(module)
    return [
        Patch(name, f"{cls}.train_step", _distribute_step_data, gated=True),
        Patch(name, f"{cls}.test_step", _distribute_step_data, gated=True),
        Patch(name, f"{cls}.predict_step", _predict_step, gated=True),
    ]


def notes() -> list[str]:
    """Upstream wrong results on this nightly that the plugin corrects."""
    module = sys.modules.get(targets.TRAINER)
    if module is None or targets.trainer_distributes_batches(module):
        return []
    return [
        "this keras-nightly's trainer never distributes batches: on its own, "
        "a mesh with the batch axis across processes trains on the wrong "
        "data; the data family distributes them (fixed upstream in "
        "3.16.0.dev2026101504)"
    ]


IMPLEMENTATION = Implementation(patches, notes=notes)
