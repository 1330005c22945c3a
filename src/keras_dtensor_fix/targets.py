"""Where Keras keeps things: layouts, versions, and the activation gate.

Nothing here imports Keras or torch. Module lookups walk the import system's
path finders without executing any module, so they are safe at any time.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import sys
from dataclasses import dataclass
from importlib.machinery import ModuleSpec

KERAS_TORCH = "keras.src.backend.torch"
CONFIG_MODULE = "keras.src.backend.config"
DISTRIBUTION_LIB = f"{KERAS_TORCH}.distribution_lib"
TRAINER = f"{KERAS_TORCH}.trainer"

#: Kinds of torch backend op modules :func:`torch_module` knows.
KINDS: tuple[str, ...] = ("numpy", "core", "nn", "math", "linalg", "image")

#: Layout name -> package that holds the op modules in that layout.
LAYOUTS: dict[str, str] = {"ops": f"{KERAS_TORCH}.ops", "flat": KERAS_TORCH}

KERAS_DISTRIBUTIONS: tuple[str, ...] = ("keras-nightly", "keras")


def torch_module(kind: str) -> tuple[str, ...]:
    """Candidate module names for a torch backend op module, newest layout first.

    ``torch_module("numpy")`` gives ``("keras.src.backend.torch.ops.numpy",
    "keras.src.backend.torch.numpy")``.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {KINDS}")
    return tuple(f"{package}.{kind}" for package in LAYOUTS.values())


def _initializing(module: object) -> bool:
    spec = getattr(module, "__spec__", None)
    return bool(getattr(spec, "_initializing", False))


def find_spec(name: str) -> ModuleSpec | None:
    """The spec of module ``name``, or ``None``; never executes a module.

    Unlike :func:`importlib.util.find_spec` this does not import parent
    packages: a parent that is not imported yet is searched on disk.
    """
    module = sys.modules.get(name)
    if module is not None:
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


def keras_imported() -> bool:
    """Whether Keras's backend configuration is imported in this process."""
    return CONFIG_MODULE in sys.modules


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
    config = sys.modules.get(CONFIG_MODULE)
    if config is None:
        return None
    try:
        return str(config.backend())
    except Exception:  # noqa: BLE001 - a broken Keras must not break us
        return None


def installed_keras() -> list[tuple[str, str]]:
    """Installed Keras distributions as ``(name, version)``, nightly first."""
    import importlib.metadata as metadata

    found = []
    for dist in KERAS_DISTRIBUTIONS:
        try:
            found.append((dist, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            continue
    return found


def keras_version() -> tuple[str | None, str | None]:
    """``(version, distribution name)`` of the installed Keras, or Nones."""
    found = installed_keras()
    if not found:
        return None, None
    dist, version = found[0]
    return version, dist


def torch_version() -> str | None:
    """The installed torch version, from its metadata (torch is not imported)."""
    import importlib.metadata as metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=8)
def _source_defines(path: str, name: str) -> bool | None:
    import re

    try:
        with open(path, encoding="utf-8") as handle:
            source = handle.read()
    except OSError:
        return None
    pattern = rf"^(?:def\s+{name}\b|{name}\s*=)"
    return re.search(pattern, source, re.MULTILINE) is not None


def distribution_support() -> bool | None:
    """Whether this Keras build has torch distribution support.

    ``None`` when it cannot be told without importing Keras modules.
    """
    module = sys.modules.get(DISTRIBUTION_LIB)
    if module is not None and not _initializing(module):
        return hasattr(module, "distribute_data_input")
    spec = find_spec(DISTRIBUTION_LIB)
    if spec is None:
        return False
    origin = spec.origin
    if origin and origin.endswith(".py"):
        return _source_defines(origin, "distribute_data_input")
    return None


@dataclass(frozen=True)
class Gate:
    """Whether patches may be applied: ``ok`` is ``None`` while undecided."""

    ok: bool | None
    reason: str


def gate() -> Gate:
    """Check the backend and the Keras build; never imports anything."""
    name = backend()
    if name is None:
        return Gate(None, "Keras is not imported yet")
    if name != "torch":
        return Gate(False, f"Keras backend is {name!r}, not 'torch': nothing to patch")
    support = distribution_support()
    if support is None:
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
