"""Data into and out of ModelParallel: ``distribute_data_input`` and friends.

* ``distribute_data_input`` is replaced: it accepts both historical signatures
  (with and without ``batch_dim_name``), walks nested structures itself, and
  keeps data on its device (upstream copies CUDA batches to the CPU and back).
* On nightlies whose trainer never distributes the batch (up to ~2026-09), the
  train/test/predict steps distribute plain batches as per-process shards, and
  ``predict`` returns each process's rows with the model axes gathered.
* ``convert_to_numpy`` gathers a DTensor's full value (early nightlies returned
  the local shard from ``get_weights()`` and ``predict()``).
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from keras_dtensor_fix.engine import Patch, note_sharding
from keras_dtensor_fix.keras_state import COMPILED_STEPS

FAMILY = "data"
MODULES = (
    "keras.src.backend.torch.distribution_lib",
    "keras.src.backend.torch.trainer",
    "keras.src.backend.torch.ops.core",
    "keras.src.backend.torch.core",
)
TRAINER = "keras.src.backend.torch.trainer"
# ``from ...core import *`` binds core's functions in these modules too.
STAR_IMPORTERS = (
    "keras.src.backend.torch.ops",
    "keras.src.backend.torch",
    "keras.src.backend",
)


def walk(data: Any, layout: Any, leaf: Callable[[Any, Any], Any]) -> Any:
    """Apply ``leaf(value, layout)`` through dicts, lists and tuples.

    ``layout`` is one layout for every leaf or a structure matching ``data``.
    """
    if isinstance(data, dict):
        return {
            k: walk(v, layout[k] if isinstance(layout, dict) else layout, leaf)
            for k, v in data.items()
        }
    if isinstance(data, (list, tuple)):
        layouts = layout if isinstance(layout, (list, tuple)) else [layout] * len(data)
        items = [walk(v, lay, leaf) for v, lay in zip(data, layouts, strict=False)]
        if hasattr(data, "_fields"):  # namedtuple
            return type(data)(*items)
        return type(data)(items)
    return leaf(data, layout)


def _placements(layout: Any) -> tuple[Any, tuple]:
    """The torch mesh and batch placements of a Keras or backend layout.

    Keras builds a new ``TensorLayout`` for every batch; its conversion is
    remembered by axes and mesh.
    """
    from keras.src.distribution.distribution_lib import TensorLayout

    key = None
    if isinstance(layout, TensorLayout):
        key = (tuple(layout.axes), layout.device_mesh)
        found = _LAYOUTS.get(key)
        if found is not None:
            return found
        layout = sys.modules[MODULES[0]]._to_backend_layout(layout)
    mesh = layout.device_mesh
    found = (mesh, trivial_axes_replicated(mesh, layout.placements))
    if key is not None:
        if len(_LAYOUTS) >= 64:
            _LAYOUTS.clear()
        _LAYOUTS[key] = found
    return found


_LAYOUTS: dict[tuple, tuple] = {}


def _distribute_leaf(value: Any, layout: Any) -> Any:
    import torch
    from torch.distributed.tensor import DTensor

    from keras_dtensor_fix.dtensor import wrap_local

    if value is None or layout is None:
        return value
    mesh, placements = _placements(layout)
    if isinstance(value, DTensor):
        if value.device_mesh == mesh and tuple(value.placements) == placements:
            return value
        return value.redistribute(mesh, placements)
    if not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)
    note_sharding()
    dtensor = wrap_local(value, mesh, placements)
    if COMPILED_STEPS:
        # A compiled step that recompiles (a guard on optimizer state, say)
        # would otherwise turn the batch size symbolic, and DTensor sharding
        # propagation fails on symbolic shard sizes. Batches keep their static
        # shapes. (Skipped while every step is eager: it costs a third of this.)
        torch._dynamo.mark_static(dtensor)
        torch._dynamo.mark_static(dtensor._local_tensor)
    return dtensor


def trivial_axes_replicated(mesh: Any, placements: Any) -> tuple:
    """``placements`` with Replicate on mesh axes of size 1.

    Sharding over a single process changes nothing but makes every reduction
    over the batch (loss, gradients) a Partial on that axis: a collective per
    value, each step, on a one-process group.
    """
    from torch.distributed.tensor import Replicate

    return tuple(
        Replicate() if size == 1 else placement
        for size, placement in zip(mesh.shape, placements, strict=True)
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
    from keras_dtensor_fix.keras_state import model_parallel

    dist = model_parallel()
    if dist is not None and args:
        data = args[0]
        args = (distribute_data_input(data, _step_layouts(dist, data)),) + args[1:]
    return wrapped(*args, **kwargs)


def _predict_step(wrapped, instance, args, kwargs):
    from keras_dtensor_fix.dtensor import gather_non_batch_axes
    from keras_dtensor_fix.keras_state import model_parallel

    dist = model_parallel()
    outputs = _distribute_step_data(wrapped, instance, args, kwargs)
    if dist is None:
        return outputs
    return walk(
        outputs, None, lambda v, _: gather_non_batch_axes(v, dist.batch_dim_name)
    )


def _sum_over(values: list, group: Any) -> list:
    """``values`` summed over ``group``: one all-reduce per dtype."""
    import torch
    import torch.distributed

    out = list(values)
    for dtype in dict.fromkeys(v.dtype for v in values):
        picked = [i for i, v in enumerate(values) if v.dtype == dtype]
        flat = torch.cat([values[i].reshape(-1) for i in picked])
        torch.distributed.all_reduce(
            flat, op=torch.distributed.ReduceOp.SUM, group=group
        )
        start = 0
        for i in picked:
            size = values[i].numel()
            out[i] = flat[start : start + size].reshape(values[i].shape)
            start += size
    return out


def _make_metrics_result(owner_name: str):
    """The ``get_metrics_result`` wrapper for the trainer class ``owner_name``."""

    def _metrics_result(wrapped, instance, args, kwargs):
        """Metric results summed over the batch axis, from DTensor metric variables.

        Each process accumulates its own batches into its (replicated) metric
        variables; the totals are their sum over the batch mesh axis. Upstream
        all-reduces every variable each step, also over a one-process batch axis,
        and early nightlies all-reduce the DTensor itself, which has no sharding
        rule for ``c10d.allreduce_``. Here one all-reduce per dtype sums them
        all; it runs inside compiled steps too (a traced patch).
        """
        from keras_dtensor_fix.keras_state import model_parallel
        from keras_dtensor_fix.patches._values import local_tensors

        dist = model_parallel()
        if dist is None:
            return wrapped(*args, **kwargs)
        import torch
        import torch.distributed
        from keras.src import backend
        from torch.distributed.tensor import DTensor

        mesh = dist.device_mesh.backend_mesh
        names = tuple(mesh.mesh_dim_names or ())
        group = None
        if dist.batch_dim_name in names:
            axis = names.index(dist.batch_dim_name)
            # Eager steps skip a one-process batch axis. Compiled steps keep
            # the (one) all-reduce: without it torch 2.13's inductor trained
            # the parity MLP differently (0.3% off the single-process losses;
            # equal with the aot_eager backend).
            if mesh.size(axis) > 1 or torch.compiler.is_compiling():
                group = mesh.get_group(axis)
        variables = instance.metrics_variables
        owner = getattr(sys.modules[TRAINER], owner_name)
        if group is None:
            # Nothing to sum: the local tensors hold the totals.
            with torch.no_grad(), local_tensors(variables):
                results = super(owner, instance).get_metrics_result()
        else:
            with torch.no_grad():
                values = [
                    v.to_local() if isinstance(v, DTensor) else v
                    for v in (variable.value for variable in variables)
                ]
                # _sum_over reduces a concatenated copy: the variables stay.
                values = _sum_over(values, group) if values else values
            with backend.StatelessScope(
                state_mapping=list(zip(variables, values, strict=True))
            ):
                results = super(owner, instance).get_metrics_result()
        return {
            k: v.clone() if isinstance(v, torch.Tensor) else v
            for k, v in results.items()
        }

    return _metrics_result


def _convert_to_numpy(wrapped, instance, args, kwargs):
    from torch.distributed.tensor import DTensor

    def full(value: Any, _layout: Any) -> Any:
        if isinstance(value, variable_class()):
            value = value.value
        if isinstance(value, DTensor):
            return value.detach().full_tensor()
        return value

    from keras_dtensor_fix.patches._values import variable_class

    if args:
        args = (walk(args[0], None, full),) + args[1:]
    return wrapped(*args, **kwargs)


def trainer_class(module: types.ModuleType) -> str:
    """The torch trainer's class name: ``Trainer`` now, ``TorchTrainer`` before."""
    for name in ("Trainer", "TorchTrainer"):
        if isinstance(getattr(module, name, None), type):
            return name
    raise LookupError(f"no Trainer class in {module.__name__}")


def patches(module: types.ModuleType) -> list[Patch]:
    name = module.__name__
    if name == MODULES[0]:
        if not hasattr(module, "distribute_data_input"):
            raise LookupError(
                "distribute_data_input not found: this Keras has no torch "
                "data distribution"
            )
        return [
            Patch(
                FAMILY,
                name,
                "distribute_data_input",
                _replace_distribute_data_input,
                also_in=(TRAINER,),
            )
        ]
    if name == TRAINER:
        cls = trainer_class(module)
        metrics = [
            Patch(
                FAMILY,
                name,
                f"{cls}.get_metrics_result",
                _make_metrics_result(cls),
                gated=True,
                traced=True,
            )
        ]
        if hasattr(module, "distribute_data_input"):
            return metrics  # this trainer distributes batches itself
        return metrics + [
            Patch(FAMILY, name, f"{cls}.train_step", _distribute_step_data, gated=True),
            Patch(FAMILY, name, f"{cls}.test_step", _distribute_step_data, gated=True),
            Patch(FAMILY, name, f"{cls}.predict_step", _predict_step, gated=True),
        ]
    return [
        Patch(
            FAMILY,
            name,
            "convert_to_numpy",
            _convert_to_numpy,
            also_in=STAR_IMPORTERS,
            gated=True,
        )
    ]


def notes() -> list[str]:
    """Upstream wrong results on this nightly that the plugin corrects."""
    import inspect

    from keras_dtensor_fix import engine

    found = []
    module = sys.modules.get(TRAINER)
    if module is not None and not hasattr(module, "distribute_data_input"):
        found.append(
            "this keras-nightly's trainer never distributes batches: on its own, "
            "a mesh with the batch axis across processes trains on the wrong "
            "data; the data family distributes them (fixed upstream in "
            "3.16.0.dev2026101504)"
        )
    for core in MODULES[2:]:
        original = engine.original(core, "convert_to_numpy")
        if original is None:
            continue
        try:
            source = inspect.getsource(original)
        except (OSError, TypeError):
            continue
        if "to_local()" in source and "full_tensor()" not in source:
            found.append(
                "this keras-nightly's get_weights() and predict() return each "
                "process's local shard on their own; the data family gathers "
                "full values (fixed upstream in 3.16.0.dev2026102704)"
            )
    return found
