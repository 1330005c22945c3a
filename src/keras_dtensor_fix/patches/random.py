"""Dropout on DTensor activations.

The mask is drawn as one process draws it, for the full shape (so every rank
and a single-process run agree), eagerly, then promoted to a Replicate
DTensor. Traced, the unseeded draw is one opaque op
(``keras_dtensor_fix::dropout_kept``) that draws when the graph runs; a
seeded draw, or one with a noise shape, breaks the graph.
"""

from __future__ import annotations

import types

import torch

from keras_dtensor_fix.dtensor import DTensor, replicate
from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require


def _bind(inputs, rate, noise_shape=None, seed=None):
    return inputs, rate, noise_shape, seed


def _draw_kept(wrapped, shape, dtype, device, rate, noise_shape, seed):
    """The kept-entries mask of the whole tensor, drawn as one process draws it."""
    if (
        _kept is not None
        and torch.compiler.is_compiling()
        and noise_shape is None
        and _unseeded(seed)
    ):
        return _kept(_DRAWS, list(shape), rate, dtype, device)

    @torch._dynamo.disable
    def draw():
        stand_in = torch.ones(shape, dtype=dtype, device=device)
        return wrapped(stand_in, rate, noise_shape, seed) != 0

    return draw()


def _unseeded(seed) -> bool:
    """Whether Keras's torch ``dropout`` takes its unseeded path for ``seed``."""
    generator = targets.keras_object("SeedGenerator")
    return seed is None or (isinstance(seed, generator) and seed._initial_seed is None)


#: In-graph draws so far: mutated, so no pass merges or reorders two draws.
_DRAWS = torch.zeros((), dtype=torch.int64)


def _define_kept():
    """The op ``keras_dtensor_fix::dropout_kept``, or None (a torch without
    ``custom_op`` tags: traced draws break the graph)."""

    def kept(
        draws: torch.Tensor,
        shape: list[int],
        rate: float,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """Keras's unseeded draw of a kept-entries mask, run when the graph runs."""
        draws.add_(1)
        stand_in = torch.ones(shape, dtype=dtype, device=device)
        return torch.nn.functional.dropout(stand_in, p=rate, training=True) != 0

    def fake(draws, shape, rate, dtype, device):
        return torch.empty(shape, dtype=torch.bool, device=device)

    try:
        op = torch.library.custom_op(
            "keras_dtensor_fix::dropout_kept",
            mutates_args=("draws",),
            tags=(torch.Tag.nondeterministic_seeded,),
        )(kept)
    except (AttributeError, TypeError, RuntimeError):
        return None
    op.register_fake(fake)
    return op


_kept = _define_kept()


def _dropout(wrapped, instance, args, kwargs):
    inputs, rate, noise_shape, seed = _bind(*args, **kwargs)
    if not isinstance(inputs, DTensor) or rate in (0.0, 1.0):
        return wrapped(*args, **kwargs)

    shape, dtype, device = tuple(inputs.shape), inputs.dtype, inputs.device
    kept = _draw_kept(wrapped, shape, dtype, device, rate, noise_shape, seed)
    mask = replicate(kept, inputs.device_mesh)
    return torch.where(mask, inputs / (1.0 - rate), torch.zeros_like(inputs))


def patches(module: types.ModuleType) -> list[Patch]:
    return [Patch(module.__name__, require(module, "dropout"), _dropout, gated=True)]


IMPLEMENTATION = Implementation(patches)
