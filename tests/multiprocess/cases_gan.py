"""The GANs of Keras's guide "Customizing what happens in fit() with
PyTorch" (two models, two optimizers, two backwards in one ``train_step``),
compiled under ModelParallel: the Dense one, and the guide's conv one (slow)."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import layers  # noqa: E402
from scenario_kit import (  # noqa: E402
    COLUMNS,
    case,
    data,
    distribute,
    fit_mlp,
    weights,
    with_plugin_warnings,
)


class _GAN(keras.Model):
    """The GAN of Keras's guide "Customizing what happens in fit() with
    PyTorch": two models, two optimizers, two backwards in one train_step."""

    def __init__(self, discriminator, generator, latent_dim: int):
        super().__init__()
        self.discriminator, self.generator = discriminator, generator
        self.latent_dim = latent_dim
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.built = True

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn, **kwargs):
        super().compile(**kwargs)
        self.d_optimizer, self.g_optimizer = d_optimizer, g_optimizer
        self.loss_fn = loss_fn

    def _latent(self, batch_size: int):
        shape = (batch_size, self.latent_dim)
        return keras.random.normal(shape, seed=self.seed_generator)

    def train_step(self, real):
        real = real[0] if isinstance(real, tuple) else real
        batch_size = real.shape[0]
        generated = self.generator(self._latent(batch_size))
        combined = torch.concat([generated, real], axis=0)
        labels = torch.concat(
            [torch.ones((batch_size, 1)), torch.zeros((batch_size, 1))], axis=0
        )
        labels += 0.05 * keras.random.uniform(labels.shape, seed=self.seed_generator)
        self.zero_grad()
        d_loss = self.loss_fn(labels, self.discriminator(combined))
        d_loss.backward()
        grads = [v.value.grad for v in self.discriminator.trainable_weights]
        with torch.no_grad():
            self.d_optimizer.apply(grads, self.discriminator.trainable_weights)
        misleading = torch.zeros((batch_size, 1))
        self.zero_grad()
        predictions = self.discriminator(self.generator(self._latent(batch_size)))
        g_loss = self.loss_fn(misleading, predictions)
        g_loss.backward()
        grads = [v.value.grad for v in self.generator.trainable_weights]
        with torch.no_grad():
            self.g_optimizer.apply(grads, self.generator.trainable_weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {m.name: m.result() for m in self.metrics}


# The GAN's first discriminator layer, and the MLP fit before it.
GAN_LAYOUT = {".*gan_d1/kernel": (None, "model"), **COLUMNS}


@case(
    "dropin_compiled",
    layout=GAN_LAYOUT,
    # Its ``backward()`` calls break the graph by design (reported).
    warns=("graph break(s)",),
)
def gan_compiled():
    """The guide's GAN compiled after another distribution's compiled fit in
    the same process (a compiled MLP on an equal (1, 2) mesh, then a new
    distribution), equal to one process, compiled to the end
    (``compiled_to_the_end``: ``fit``'s train function still runs the
    compiled step) with no fallback warning (test_compiled_gan_stays_compiled).
    Before ``dtensor.forget_meshes``: DTensor's sharding caches (the C++ fast
    path's too) match meshes by value and handed the GAN's loss ops the
    earlier mesh object; the first batch's compile of a loss frame failed in
    AOT autograd's partitioner ("Node tangents_2 was invalid, but is output":
    that mesh was reachable only through the tangent built from the frame's
    output) and the step ran eagerly, warned (``runs eagerly from now on``),
    inductor and aot_eager alike. Its graph breaks:
    ``binary_cross_entropy_with_logits`` has no DTensor sharding rule, so the
    loss's frames run eagerly (the ``ops`` family's full-value fallback)
    between compiled graphs; ``backward()``. Issue 50 saw "Expected a DTensor
    tangent but got a plain Tensor" in ``d_loss.backward()`` on a later
    batch. Upstream runs it eagerly."""
    fit_mlp(keras.optimizers.Adam(1e-2), epochs=2, jit_compile=True)
    # A new mesh, equal to the one before; the MLP's rule (COLUMNS) would
    # match nothing of the GAN's, and warn.
    distribute((1, 2), {".*gan_d1/kernel": GAN_LAYOUT[".*gan_d1/kernel"]})
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential(
        [
            layers.Input((16,)),
            layers.Dense(8, activation="relu", name="gan_d1"),
            layers.Dense(1, name="gan_d2"),
        ]
    )
    generator = keras.Sequential(
        [
            layers.Input((8,)),
            layers.Dense(8, activation="relu", name="gan_g1"),
            layers.Dense(16, name="gan_g2"),
        ]
    )
    x, _ = data(32, 16)
    return _fit_compiled(_GAN(discriminator, generator, latent_dim=8), x, batch_size=8)


def _fit_compiled(gan: _GAN, real: np.ndarray, batch_size: int) -> dict:
    """One epoch of the guide's compiled GAN on ``real``: its losses, weights,
    whether it compiled to the end, its graph breaks and DTensor helper
    frames, and the plugin's warnings."""
    gan.compile(
        d_optimizer=keras.optimizers.Adam(3e-4),
        g_optimizer=keras.optimizers.Adam(3e-4),
        loss_fn=keras.losses.BinaryCrossentropy(from_logits=True),
        jit_compile=True,
    )

    def fit():
        import torch._dynamo.utils

        history = gan.fit(
            real, batch_size=batch_size, epochs=1, shuffle=False, verbose=0
        )
        breaks = torch._dynamo.utils.counters["graph_break"]
        return {
            "losses": history.history["d_loss"] + history.history["g_loss"],
            "weights": weights(gan),
            "compiled_to_the_end": _compiled_step(gan.train_function),
            "graph_breaks": sum(breaks.values()),
            "helper_frames": _helper_frames(),
        }

    return with_plugin_warnings(fit)


def _helper_frames() -> int:
    """The frames dynamo compiled of DTensor's subclass methods, which torch's
    runtime of a compiled graph calls in ``backward()`` (0: run as plain
    Python)."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.distributed.tensor import DTensor

    names = (
        "__tensor_flatten__",
        "__tensor_unflatten__",
        "__coerce_tangent_metadata__",
        "__coerce_same_metadata_as_tangent__",
    )
    codes = [getattr(DTensor, n).__code__ for n in names if hasattr(DTensor, n)]
    return sum(len(_debug_get_cache_entry_list(code)) for code in codes)


def _compiled_step(train_function) -> bool:
    """Whether ``fit``'s train function still runs a torch.compile'd step
    (the eager fallback rebuilds it around the bare ``train_step``)."""
    import inspect

    cells = inspect.unwrap(train_function).__closure__ or ()
    return any(hasattr(c.cell_contents, "_torchdynamo_orig_callable") for c in cells)


# The guide's conv GAN, small: each conv kernel's output channels on "model"
# (a transposed conv's kernel is (h, w, out, in)); the last conv has one.
CONV_GAN_LAYOUT = {
    ".*gan_cd\\d/kernel": (None, None, None, "model"),
    ".*gan_cg\\d/kernel": (None, None, "model", None),
}


@case("dropin_compiled", layout=CONV_GAN_LAYOUT, warns=("graph break(s)",), slow=True)
def conv_gan_compiled():
    """The guide's conv GAN (its layers on 8x8 images, few filters, conv
    kernels split on "model") compiled: equal to one process, compiled to the
    end, no fallback warning, and none of DTensor's subclass methods compiled
    as a frame (``helper_frames``; test_compiled_gan_stays_compiled). Its
    three random draws break the graph (Keras's seed generator); each
    ``backward()`` ran, before ``compiled/frames.py``, with dynamo compiling
    DTensor's ``__tensor_unflatten__`` once per gradient shape to its
    recompile limit. Minutes of compiling on 2 cores: the slow tier (the
    Dense GAN is the default tier's). Upstream fails it: torch's DTensor
    convolution computes with the local kernel shard ("must match the size of
    tensor b")."""
    keras.utils.set_random_seed(0)
    discriminator = keras.Sequential(
        [
            layers.Input((8, 8, 1)),
            layers.Conv2D(4, 3, strides=2, padding="same", name="gan_cd1"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(8, 3, strides=2, padding="same", name="gan_cd2"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.GlobalMaxPooling2D(),
            layers.Dense(1),
        ]
    )
    generator = keras.Sequential(
        [
            layers.Input((4,)),
            layers.Dense(2 * 2 * 8),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Reshape((2, 2, 8)),
            layers.Conv2DTranspose(8, 4, strides=2, padding="same", name="gan_cg1"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2DTranspose(8, 4, strides=2, padding="same", name="gan_cg2"),
            layers.LeakyReLU(negative_slope=0.2),
            layers.Conv2D(1, 3, padding="same", activation="sigmoid"),
        ]
    )
    gan = _GAN(discriminator, generator, latent_dim=4)
    images = np.random.default_rng(0).uniform(size=(16, 8, 8, 1)).astype("float32")
    return _fit_compiled(gan, images, batch_size=4)
