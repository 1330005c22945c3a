"""A model built and run once for planning, and nothing of it left behind.

``build()`` runs under no distribution on torch's ``meta`` device (on the CPU
when a host read fails there), then one forward runs on inputs of
``model.inputs``' shapes (or ``sample_input``) under the dataflow's watch.
Keras's layer names, its seed generator and the random states are put back.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.planning.dataflow import Dataflow, trace

__all__ = ["Traced", "trace_model"]

_LOG = logging.getLogger("keras_dtensor_fix.planning")
#: Unknown input dims: the batch, then any other (a sequence).
_BATCH, _OTHER = 2, 8


@dataclass
class Traced:
    """The weights (path -> shape, bytes) and the dataflow of one forward."""

    shapes: dict[str, tuple[int, ...]]
    nbytes: dict[str, int]
    flow: Dataflow
    device: str


def trace_model(build: Callable[[], Any], sample_input: Any = None) -> Traced:
    """Build with ``build()`` and trace one forward, on ``meta`` where it runs."""
    if not callable(build) or isinstance(build, targets.keras_object("Layer")):
        raise TypeError(
            f"build must be a callable that builds and returns the model, got "
            f"{type(build).__name__}; pass e.g. `lambda: make_model()`"
        )
    try:
        return _trace(build, sample_input, "meta")
    except _NoInputs:
        raise
    except Exception as exc:  # noqa: BLE001 - a host read on meta: rerun on cpu
        _LOG.debug("planning on meta failed (%s: %s); on cpu", type(exc).__name__, exc)
    return _trace(build, sample_input, "cpu")


class _NoInputs(ValueError):
    pass


def _trace(build, sample_input, device: str) -> Traced:
    import keras

    with _put_back() as state, keras.device(device):
        state.set_global_attribute("distribution", None)  # plan unsharded
        model = build()
        if not isinstance(model, keras.Model | keras.layers.Layer):
            raise TypeError(
                f"build() returned {type(model).__name__}, not a Keras model; it "
                "must build the model and return it"
            )
        inputs = _inputs(model, sample_input, device)
        if not model.weights:  # built lazily: its first call builds it
            model(inputs)
        variables = list({id(v): v for v in model.weights}.values())
        weights = {id(v.value): (v.path, v.value) for v in variables}
        if device == "meta":
            state.set_global_attribute("torch_device", _Meta("meta"))
        flow = trace(lambda: model(inputs, training=False), weights)
    shapes = {v.path: tuple(v.shape) for v in variables}
    nbytes = {v.path: v.value.numel() * v.value.element_size() for v in variables}
    return Traced(shapes, nbytes, flow, device)


class _Meta(str):
    """ "meta" to torch, not to Keras's ``get_device() == "meta"`` tests,
    whose branches make outputs afresh and cut the dataflow (the forward only:
    building needs Keras's meta branch to draw without a generator)."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return other is self

    __hash__ = str.__hash__


def _inputs(model, sample_input, device: str) -> Any:
    tree = targets.keras_object("tree")
    if sample_input is not None:
        return tree.map_structure(lambda x: _tensor(x, device), sample_input)
    specs = getattr(model, "inputs", None) if model.built else None
    if not specs:
        raise _NoInputs(
            f"{type(model).__name__} has no Input shapes to plan from: pass "
            "sample_input= (one batch, as model(x) takes it)"
        )
    inputs = [_ones(spec, device) for spec in specs]
    structure = getattr(model, "_inputs_struct", None)
    if isinstance(structure, dict) and len(structure) == len(specs):
        by_name = {
            getattr(s, "name", None): x for s, x in zip(specs, inputs, strict=True)
        }
        return {
            k: by_name.get(getattr(v, "name", k), by_name.get(k))
            for k, v in structure.items()
        }
    return inputs[0] if len(inputs) == 1 else inputs


def _ones(spec, device: str) -> torch.Tensor:
    shape = [
        (_BATCH if i == 0 else _OTHER) if d is None else d
        for i, d in enumerate(spec.shape)
    ]
    return torch.ones(shape, dtype=getattr(torch, str(spec.dtype)), device=device)


def _tensor(x, device: str) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, np.ndarray | np.generic | list | int | float):
        return torch.as_tensor(np.asarray(x), device=device)
    return x


@contextlib.contextmanager
def _put_back() -> Iterator[Any]:
    """Keras's global state, holding the layer names, the seed generator, the
    distribution and the device, and the random states, as they were before."""
    state = targets.keras_object("global_state")
    names = copy.deepcopy(state.get_global_attribute("object_name_uids"))
    seeds = state.get_global_attribute("global_seed_generator")
    seed_state = None if seeds is None else seeds.state.value.detach().clone()
    kept = {k: state.get_global_attribute(k) for k in ("distribution", "torch_device")}
    randoms = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    try:
        yield state
    finally:
        state.set_global_attribute("object_name_uids", names)
        state.set_global_attribute("global_seed_generator", seeds)
        if seeds is not None:
            seeds.state.assign(seed_state)
        for key, value in kept.items():
            state.set_global_attribute(key, value)
        torch.random.set_rng_state(randoms[0])
        np.random.set_state(randoms[1])
        random.setstate(randoms[2])
