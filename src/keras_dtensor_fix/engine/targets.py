"""Every Keras name the plugin knows: modules by kind, aliases, objects, capabilities.
The one owner of ``keras.src`` paths; nothing here imports Keras or torch at import, and
module lookups execute no module."""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import re
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

#: The package whose import completes Keras: families' preloads run then.
KERAS = "keras"
KERAS_TORCH = "keras.src.backend.torch"
CONFIG_MODULE = "keras.src.backend.config"
DISTRIBUTION_LIB = f"{KERAS_TORCH}.distribution_lib"
TRAINER = f"{KERAS_TORCH}.trainer"
#: Keras's backend-independent distribution API (``ModelParallel`` and co).
DISTRIBUTION_API = "keras.src.distribution.distribution_lib"
#: Modules a family tells apart from the others of their kind (each holds
#: another class to patch).
COMPILE_UTILS = "keras.src.trainers.compile_utils"
EINSUM_DENSE = "keras.src.layers.core.einsum_dense"


#: Layout name -> package that holds the op modules in that layout: ``ops``
#: from about 2026-10, ``flat`` before.
LAYOUTS: dict[str, str] = {"ops": f"{KERAS_TORCH}.ops", "flat": KERAS_TORCH}

#: The torch optimizers with a ``_parallel_update_step``.
OPTIMIZERS: tuple[str, ...] = (
    "adadelta",
    "adagrad",
    "adam",
    "adamax",
    "adamw",
    "lion",
    "nadam",
    "rmsprop",
    "sgd",
)


def torch_module(*kinds: str) -> tuple[str, ...]:
    """The torch backend's modules of ``kinds`` in every layout, newest first."""
    return tuple(f"{package}.{kind}" for package in LAYOUTS.values() for kind in kinds)


_OPTIMIZERS = f"{KERAS_TORCH}.optimizers"


def per_variable_update(function: object) -> bool:
    """Whether ``function`` is the ``_parallel_update_step`` of one of Keras's
    :data:`OPTIMIZERS` (not a subclass's own) that reads and writes only the variables
    given and their own slots, so that updating a few at a time is exact: not Nadam's,
    which also advances a product shared by every variable."""
    module = getattr(function, "__module__", None)
    return (
        module in MODULES["optimizers"]
        and module != f"{_OPTIMIZERS}.torch_nadam"
        and getattr(function, "__name__", None) == "_parallel_update_step"
    )


#: Module kind -> the modules of that kind, in every layout.
MODULES: dict[str, tuple[str, ...]] = {
    "numpy": torch_module("numpy"),
    "ops": torch_module("nn", "math", "linalg", "image", "core"),
    "core": torch_module("core"),
    "distribution_lib": (DISTRIBUTION_LIB,),
    "distribution_api": (DISTRIBUTION_API,),
    "trainer": (TRAINER,),
    "random": (f"{KERAS_TORCH}.random",),
    "optimizers": tuple(f"{_OPTIMIZERS}.torch_{name}" for name in OPTIMIZERS),
    "parallel_optimizer": (f"{_OPTIMIZERS}.torch_parallel_optimizer",),
    "base_optimizer": ("keras.src.optimizers.base_optimizer",),
    "loss_scale_optimizer": ("keras.src.optimizers.loss_scale_optimizer",),
    "loss_and_metrics": (COMPILE_UTILS, "keras.src.metrics.reduction_metrics"),
    "dense_layers": ("keras.src.layers.core.dense", EINSUM_DENSE),
    "layer_base": ("keras.src.layers.layer",),
    "saving": ("keras.src.saving.saving_lib",),
    "backup_and_restore": ("keras.src.callbacks.backup_and_restore",),
    "file_utils": ("keras.src.utils.file_utils",),
    "rnn": (f"{KERAS_TORCH}.rnn",),
    "epoch_iterator": ("keras.src.trainers.epoch_iterator",),
    # keras-hub's and torch's:
    "causal_lm": ("keras_hub.src.models.causal_lm",),
    "hub_backbone": ("keras_hub.src.models.backbone",),
    "rendezvous": ("torch.distributed.rendezvous",),
    "elastic_agent": ("torch.distributed.elastic.agent.server.local_elastic_agent",),
    "dynamo_utils": ("torch._dynamo.utils",),
    "inductor_codecache": ("torch._inductor.codecache",),
}

#: Keras's and keras-hub's leaf layers that read across only some axes of
#: their input, by ``(module, class)``, with their kind: what the ``leaves``
#: family asks of each (see there).
MIXING_LAYERS: dict[tuple[str, str], str] = {
    ("keras.src.layers.activations.softmax", "Softmax"): "softmax",
    ("keras_hub.src.layers.modeling.rotary_embedding", "RotaryEmbedding"): "rotary",
    (
        "keras_hub.src.models.llama.llama_rotary_embedding",
        "LlamaRotaryEmbedding",
    ): "rotary",
}

#: Module kind -> modules that bind that kind's functions by name (``from
#: .numpy import add``, ``from .core import *``): a patch replaces them there too.
ALIASES: dict[str, tuple[str, ...]] = {
    "numpy": torch_module("nn", "math", "core", "linalg", "image")
    + tuple(f"{KERAS_TORCH}.{kind}" for kind in ("random", "rnn")),
    "core": tuple(LAYOUTS.values()),
    "core_star": (*LAYOUTS.values(), "keras.src.backend"),
    # ``from ...core import convert_to_tensor`` in every op module and more.
    "core_by_name": torch_module("numpy", "nn", "math", "linalg", "image")
    + tuple(
        f"{KERAS_TORCH}.{name}"
        for name in ("random", "rnn", "trainer", "distribution_lib", "layer")
    )
    + (*LAYOUTS.values(), KERAS_TORCH, "keras.src.backend"),
    "trainer": (TRAINER,),
    # Its package and ``keras.distribution``'s public modules bind them by name.
    "distribution_api": (
        "keras.src.distribution",
        "keras.distribution",
        "keras._tf_keras.keras.distribution",
    ),
    "dynamo_utils": ("torch._functorch._aot_autograd.autograd_cache",),
}

#: Keras objects the patches use, by name: ``(module, attribute)``; the
#: module may be a tuple of candidates, one per layout, newest first.
OBJECTS: dict[str, tuple[str | tuple[str, ...], str]] = {
    "Variable": ("keras.src.backend.common.variables", "Variable"),
    "StatelessScope": ("keras.src.backend", "StatelessScope"),
    "Layer": ("keras.src.layers.layer", "Layer"),
    "Model": ("keras.src.models.model", "Model"),
    "Functional": ("keras.src.models.functional", "Functional"),
    "Function": ("keras.src.ops.function", "Function"),
    "unpack_singleton": ("keras.src.models.functional", "unpack_singleton"),
    "BaseTrainer": ("keras.src.trainers.trainer", "BaseTrainer"),
    "unpack_x_y_sample_weight": (
        "keras.src.trainers.data_adapters.data_adapter_utils",
        "unpack_x_y_sample_weight",
    ),
    "in_symbolic_scope": ("keras.src.backend", "in_symbolic_scope"),
    "in_stateless_scope": ("keras.src.backend", "in_stateless_scope"),
    "RNN": ("keras.src.layers.rnn.rnn", "RNN"),
    "LSTM": ("keras.src.layers.rnn.lstm", "LSTM"),
    "GRU": ("keras.src.layers.rnn.gru", "GRU"),
    "SeedGenerator": ("keras.src.random.seed_generator", "SeedGenerator"),
    "TensorLayout": (DISTRIBUTION_API, "TensorLayout"),
    "tree": ("keras.src", "tree"),
    "distribution": (DISTRIBUTION_API, "distribution"),
    "global_state": ("keras.src.backend.common", "global_state"),
    "MonitorCallback": ("keras.src.callbacks.monitor_callback", "MonitorCallback"),
    "activations": ("keras.src.activations", "activations"),
    "Dense": ("keras.src.layers.core.dense", "Dense"),
    "EinsumDense": (EINSUM_DENSE, "EinsumDense"),
    "ReversibleEmbedding": (
        "keras.src.layers.core.reversible_embedding",
        "ReversibleEmbedding",
    ),
    "get_device": (torch_module("core"), "get_device"),
}


def is_kind(module_name: str, kind: str) -> bool:
    """Whether ``module_name`` is one of the modules of ``kind``."""
    return module_name in MODULES[kind]


_FOUND: dict[str, Any] = {}


def keras_object(name: str) -> Any:
    """A Keras object of :data:`OBJECTS`, its module imported on first use; a plain dict
    cache, which dynamo traces (a compiled step calls this)."""
    found = _FOUND.get(name)
    if found is None:
        modules, attribute = OBJECTS[name]
        candidates = (modules,) if isinstance(modules, str) else modules
        module = next(filter(find_spec, candidates[:-1]), candidates[-1])
        found = _FOUND[name] = getattr(importlib.import_module(module), attribute)
    return found


def trainer_class(module: ModuleType) -> str:
    """The torch trainer's class name: ``Trainer`` now, ``TorchTrainer`` before."""
    for name in ("Trainer", "TorchTrainer"):
        if isinstance(getattr(module, name, None), type):
            return name
    raise LookupError(f"no Trainer class in {module.__name__}")


def trainer_distributes_batches(module: ModuleType) -> bool:
    """Whether this trainer distributes each batch itself (from 2026-10-15)."""
    return hasattr(module, "distribute_data_input")


def trainer_compiles_model_parallel(module: ModuleType) -> bool:
    """Whether this trainer can compile a ModelParallel step (from 2026-10-27)."""
    return "_use_torch_compile" in vars(getattr(module, trainer_class(module)))


#: The first torch whose dynamo traces ``torch.autograd.grad`` (Keras's compiled
#: train step) over DTensors; 2.11 asserts that every tensor is a FakeTensor.
FIRST_COMPILING_TORCH = (2, 12)


def torch_compiles_dtensor_grad() -> bool:
    """Whether the installed torch can compile a ModelParallel train step."""
    torch = sys.modules.get("torch")
    version = getattr(torch, "__version__", None) or torch_version() or "0.0"
    found = re.match(r"(\d+)\.(\d+)", str(version))  # "2.13.0+cpu"
    return bool(found) and (int(found[1]), int(found[2])) >= FIRST_COMPILING_TORCH


def convert_to_numpy_gathers(function: Any) -> bool:
    """Whether Keras's ``convert_to_numpy`` returns a DTensor's full value (not before
    2026-10-27)."""
    import inspect

    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return True
    return "full_tensor()" in source or "to_local()" not in source


def initializing(module: object) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def find_spec(name: str) -> ModuleSpec | None:
    """The spec of module ``name``, or None, without importing parent packages."""
    if (module := sys.modules.get(name)) is not None:
        return getattr(module, "__spec__", None)
    parent, _, _ = name.rpartition(".")
    if not parent or parent in sys.modules:
        try:
            return importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
    parent_spec = find_spec(parent)
    locations = getattr(parent_spec, "submodule_search_locations", None)
    if not locations:
        return None
    return importlib.machinery.PathFinder.find_spec(name, list(locations))


def layout() -> str | None:
    """``"ops"``, ``"flat"`` or ``"unknown"``; ``None`` before Keras is imported."""
    if "keras" not in sys.modules:
        return None
    for name, package in LAYOUTS.items():
        if find_spec(f"{package}.numpy") is not None:
            return name
    return "unknown"


def backend() -> str | None:
    """Keras's backend name, read only if Keras is already imported."""
    if (config := sys.modules.get(CONFIG_MODULE)) is None:
        return None
    try:
        return str(config.backend())
    except Exception:  # noqa: BLE001 - a broken Keras must not break us
        return None


def installed_keras() -> list[tuple[str, str]]:
    """Installed Keras distributions as ``(name, version)``, nightly first."""
    found = ((dist, _installed(dist)) for dist in ("keras-nightly", "keras"))
    return [(dist, version) for dist, version in found if version]


def keras_version() -> tuple[str | None, str | None]:
    """``(version, distribution name)`` of the Keras whose files are in use: with
    both installed, the last one installed (it overwrote the other's files)."""
    found = installed_keras()
    if not found:
        return None, None
    spec = find_spec("keras.src.version")
    source = (spec and spec.origin and _source(spec.origin)) or ""
    assigned = re.search(r"^__version__\s*=\s*[\"']([^\"']+)", source, re.M)
    in_use = assigned and assigned[1]
    dist, version = next(((d, v) for d, v in found if v == in_use), found[0])
    return version, dist


def torch_version() -> str | None:
    """The installed torch version, from its metadata (torch is not imported)."""
    return _installed("torch")


def _installed(dist: str) -> str | None:
    import importlib.metadata as metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=16)
def _source(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return handle.read()
    except OSError:
        return None


def distribution_support() -> bool | None:
    """Whether this Keras build has torch distribution support (None: cannot tell
    without importing Keras)."""
    module = sys.modules.get(DISTRIBUTION_LIB)
    if module is not None and not initializing(module):
        return hasattr(module, "distribute_data_input")
    spec, package = find_spec(DISTRIBUTION_LIB), find_spec(KERAS_TORCH)
    # A backend package that never imports it: stable keras installed over
    # the nightly leaves the nightly's distribution_lib.py behind, unused.
    imports = package and package.origin and _source(package.origin)
    if spec is None or (imports is not None and "distribution_lib" not in imports):
        return False
    source = _source(spec.origin) if (spec.origin or "").endswith(".py") else None
    if source is None:
        return None
    defines = r"^(?:def\s+distribute_data_input\b|distribute_data_input\s*=)"
    return re.search(defines, source, re.MULTILINE) is not None


@dataclass(frozen=True)
class Gate:
    """Whether patches may be applied: ``ok`` is ``None`` while undecided."""

    ok: bool | None
    reason: str


def gate() -> Gate:
    """Check the backend and the Keras build; never imports anything."""
    if (name := backend()) is None:
        return Gate(None, "Keras is not imported yet")
    if name != "torch":
        return Gate(False, f"Keras backend is {name!r}, not 'torch': nothing to patch")
    if (support := distribution_support()) is None:
        return Gate(None, "cannot tell yet whether this Keras supports torch DTensors")
    if not support:
        version, dist = keras_version()
        build = f"{dist} {version}" if dist else "this Keras build"
        return Gate(
            False,
            f"{build} has no torch distribution support "
            f"({DISTRIBUTION_LIB}.distribute_data_input is missing): nothing to "
            "patch; keras-nightly has it",
        )
    return Gate(True, f"Keras torch backend with distribution support ({layout()})")
