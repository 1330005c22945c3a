"""Scenarios: Keras layers sharded, compiled steps, the harness's own case."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import layers  # noqa: E402
from scenario_kit import (  # noqa: E402
    COLUMNS,
    MEGATRON,
    RANK,
    TRANSFORMER,
    WORLD,
    case,
    data,
    fit_mlp,
    fit_model,
    fit_rank_rows,
    mlp,
    weights,
    with_plugin_warnings,
)

# ---------------------------------------------------------------- layers


@case(
    "layers",
    layout={
        ".*embedding/embeddings": (None, "model"),
        ".*dense.*/kernel": (None, "model"),
    },
)
def embedding():
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 50, size=(64, 6)).astype("int32")
    target = rng.normal(size=(64, 1)).astype("float32")
    model = keras.Sequential(
        [
            layers.Input((6,), dtype="int32"),
            layers.Embedding(50, 8, name="embedding"),
            layers.GlobalAveragePooling1D(),
            layers.Dense(16, activation="relu", name="dense_1"),
            layers.Dense(1, name="dense_2"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(
        tokens, target, batch_size=16, epochs=3, shuffle=False, verbose=0
    )
    return {"losses": history.history["loss"], "weights": weights(model)}


def _images():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, 8, 8, 4)).astype("float32")
    y = rng.normal(size=(32, 2)).astype("float32")
    return x, y


def _conv_model():
    return keras.Sequential(
        [
            layers.Input((8, 8, 4)),
            layers.Conv2D(4, 3, activation="relu", name="conv"),
            layers.BatchNormalization(name="bn"),
            layers.GlobalAveragePooling2D(),
            layers.Dense(2, name="dense_1"),
        ]
    )


@case(
    "layers",
    layout={
        ".*conv/kernel": (None, None, "model", None),
        ".*dense_1/kernel": (None, "model"),
    },
)
def conv2d_batchnorm():
    """Conv2D kernel sharded on input channels, BatchNormalization beside it."""
    x, y = _images()
    model = _conv_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


@case("layers", layout={".*conv/kernel": (None, None, None, "model")})
def conv2d_output_channels():
    """Conv2D kernel sharded on output channels (torch's rule mislabels it)."""
    x, y = _images()
    model = _conv_model()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


def transformer_block(
    seq: int = 8, dim: int = 16, heads: int = 2, dropout: float = 0.1
):
    inputs = layers.Input((seq, dim))
    attention = layers.MultiHeadAttention(heads, dim // heads, name="mha")(
        inputs, inputs
    )
    x = layers.LayerNormalization(name="ln_1")(inputs + attention)
    hidden = layers.Dense(4 * dim, activation="relu", name="ffn_1")(x)
    if dropout:
        hidden = layers.Dropout(dropout, seed=7)(hidden)
    x = layers.LayerNormalization(name="ln_2")(
        x + layers.Dense(dim, name="ffn_2")(hidden)
    )
    outputs = layers.Dense(1, name="head")(layers.GlobalAveragePooling1D()(x))
    return keras.Model(inputs, outputs)


def _fit_transformer(jit_compile: bool = False, dropout: float = 0.1):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(32, 8, 16)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    model = transformer_block(dropout=dropout)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=jit_compile
    )
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


@case("layers", layout=TRANSFORMER)
def attention_layernorm_dropout():
    return _fit_transformer()


LEAVES = {
    ".*cols/kernel": (None, "model"),  # features split: (8, 6, 32) sharded on dim 2
    ".*rows/kernel": ("model", None),
    ".*out/kernel": (None, None),
}


@case("layers", layout=LEAVES)
def leaf_layers_local_and_not():
    """Leaf layers on local tensors where a rank's piece computes alone, and
    not where it would read across a split (``leaves`` family): a norm with
    weights and a softmax over the split features must take DTensor's path;
    a softmax over the sequence of a head-split activation and a norm of a
    replicated one run locally. Equal to one process either way. Upstream
    (``KERAS_DTENSOR_FIX=0``) trains it too, equal to one process: its
    dispatch mode takes every op through DTensor."""
    inputs = layers.Input((6, 16))
    split = layers.Dense(32, name="cols")(inputs)  # (b, 6, 32), features split
    heads = layers.Reshape((6, 4, 8))(split)  # the split is on the 4 heads
    heads = layers.Softmax(axis=1, name="softmax_seq")(heads)  # local shards
    across = layers.Softmax(axis=-1, name="softmax_split")(split)  # reads across
    h = layers.Add()([layers.Reshape((6, 32))(heads), across])
    h = layers.LayerNormalization(name="ln_split")(h)  # weights meet a split
    h = layers.Dense(16, name="rows")(h)
    h = layers.LayerNormalization(name="ln_whole")(h)  # local, replicated
    outputs = layers.Dense(4, name="out")(layers.GlobalAveragePooling1D()(h))
    rng = np.random.default_rng(8)
    x = rng.normal(size=(32, 6, 16)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    return fit_model(keras.Model(inputs, outputs), x, y)


# ---------------------------------------------------------------- compiled


@case("compiled", layout=MEGATRON, inductor=True)
def compiled_mlp():
    return fit_mlp(keras.optimizers.Adam(1e-2), jit_compile=True)


@case("compiled", layout=MEGATRON)
def compiled_train_on_batch():
    """``train_on_batch`` compiled: Keras distributes its first batch before
    it builds the compiled step, so that step's trace saw the batch before the
    ``data`` family marked it static; the mark at the second call failed a
    guard, the step compiled again and the plugin warned of it."""
    x, y = data()
    model = mlp()
    model.compile(keras.optimizers.Adam(1e-2), loss="mse", jit_compile=True)

    def train() -> dict:
        losses = [
            float(model.train_on_batch(x[i : i + 16], y[i : i + 16]))
            for i in (0, 16, 32, 48)
        ]
        return {"losses": losses, "weights": weights(model)}

    return with_plugin_warnings(train)


@case("compiled", layout=TRANSFORMER)
def compiled_transformer():
    # No seeded dropout: its generator is a graph break, which the plugin
    # refuses to compile under ModelParallel (see compiled_seeded_dropout).
    return _fit_transformer(jit_compile=True, dropout=0.0)


@case(
    "compiled", mesh=(2, 1), layout={".*dense_1/kernel": (None, "model")}, per_rank=True
)
def compiled_batch_axis():
    """(2,1), compiled: metric sums over the batch axis run inside the step."""
    return fit_rank_rows(jit_compile=True)


@case("compiled4", mesh=(2, 2), layout=MEGATRON, per_rank=True, inductor=True)
def compiled_mlp_2x2():
    """(2, 2), compiled: each mesh axis splits the 4 processes into 2 groups."""
    return fit_rank_rows(batch_ranks=2 if WORLD > 1 else 1, jit_compile=True)


@case("compiled", layout=TRANSFORMER)
def compiled_seeded_dropout():
    """jit_compile=True with a seeded Dropout runs eagerly (with a warning)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _fit_transformer(jit_compile=True)
    if WORLD > 1:
        messages = [str(w.message) for w in caught]
        assert any("graph break" in m or "cannot compile" in m for m in messages), (
            messages
        )
    return result


# ---------------------------------------------------------------- harness


@case("harness", layout=COLUMNS)
def one_rank_fails():
    """The last rank fails before a collective the others wait in."""
    if WORLD > 1 and RANK == WORLD - 1:
        raise RuntimeError("this rank fails alone")
    if WORLD > 1:
        torch.distributed.barrier()
    return {"losses": []}
