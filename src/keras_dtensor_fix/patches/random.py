"""Dropout on DTensor activations.

The torch backend draws a mask as a plain tensor (seeded: from Keras's seed
generator; unseeded: torch's own dropout on its global generator) and combines
it with the activations outside the numpy ops. On a DTensor the mask is drawn
the same way for the full shape (so every rank and a single-process run
agree), eagerly, and promoted to a Replicate DTensor before the ``where``. In a
compiled step the eager draw is a graph break (reported by the ``compile``
family; where torch's backward then fails, its step runs eagerly).
"""

from __future__ import annotations

import types

import torch

from keras_dtensor_fix.dtensor import DTensor, replicate
from keras_dtensor_fix.engine.contract import Implementation, Patch


def _bind(inputs, rate, noise_shape=None, seed=None):
    return inputs, rate, noise_shape, seed


def _draw_kept(wrapped, shape, dtype, device, rate, noise_shape, seed):
    """The kept-entries mask the original draws for the whole (global) tensor.

    Run eagerly (like Keras's own seeded generator): traced (torch 2.13), the
    draw did not match the single-process one.
    """

    @torch._dynamo.disable
    def draw():
        stand_in = torch.ones(shape, dtype=dtype, device=device)
        return wrapped(stand_in, rate, noise_shape, seed) != 0

    return draw()


def _dropout(wrapped, instance, args, kwargs):
    inputs, rate, noise_shape, seed = _bind(*args, **kwargs)
    if not isinstance(inputs, DTensor) or rate in (0.0, 1.0):
        return wrapped(*args, **kwargs)

    kept = _draw_kept(
        wrapped,
        tuple(inputs.shape),
        inputs.dtype,
        inputs.device,
        rate,
        noise_shape,
        seed,
    )
    mask = replicate(kept, inputs.device_mesh)
    keep_prob = 1.0 - rate
    return torch.where(mask, inputs / keep_prob, torch.zeros_like(inputs))


def patches(module: types.ModuleType) -> list[Patch]:
    if not hasattr(module, "dropout"):
        raise LookupError("random.dropout not found")
    return [Patch(module.__name__, "dropout", _dropout, gated=True)]


IMPLEMENTATION = Implementation(patches)
