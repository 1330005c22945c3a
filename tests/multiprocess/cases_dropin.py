"""Scenarios that run on upstream Keras too (drop-in), eager and compiled."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import layers  # noqa: E402
from scenario_kit import (  # noqa: E402
    CASES,
    COLUMNS,
    MEGATRON,
    TRANSFORMER,
    apply_step,
    case,
    data,
    fit_mlp,
    fit_model,
    mlp,
    weights,
    with_plugin_warnings,
)

# ---------------------------------------------------------------- drop-in
# Raw torch operators meeting a plain tensor and a DTensor (upstream's
# promotion mode covers them; the plugin holds DTensor's implicit replication
# on), and layers whose sharding DTensor's own rules get wrong.

KERNELS = {".*kernel": (None, "model")}
# A sharded bias: loss scaling's raw multiply meets its DTensor gradient.
BIASED = {**MEGATRON, ".*dense_1/bias": ("model",)}
# A plain-target loss, loss scaling, and the recurrent layers' raw matmuls.
RAW_OPERATOR_CASES = (
    "custom_loop_keras_loss",
    "loss_scale_sgd_fp16",
    "loss_scale_sgd_bf16",
    "lstm",
    "gru",
)


@case("dropin", layout=BIASED)
def custom_loop_keras_loss():
    """A Keras loss called directly on plain targets in a custom loop."""
    x, y = data()
    model = mlp()
    model.build((None, 16))
    optimizer = keras.optimizers.SGD(0.1)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()
    losses = []
    for step in range(4):
        rows = slice(step * 16, (step + 1) * 16)
        xb, yb = torch.from_numpy(x[rows]), torch.from_numpy(y[rows])
        loss = loss_fn(yb, model(xb))  # mean((y - pred)**2) with Python operators
        losses.append(apply_step(model, optimizer, loss))
    return {"losses": losses, "weights": weights(model)}


def _loss_scaled(policy: str):
    keras.mixed_precision.set_dtype_policy(policy)
    try:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
        return fit_mlp(optimizer, epochs=2)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@case("dropin", layout=BIASED)
def loss_scale_sgd_fp16():
    return _loss_scaled("mixed_float16")


@case("dropin", layout=BIASED)
def loss_scale_sgd_bf16():
    return _loss_scaled("mixed_bfloat16")


def _sequences(n: int = 32, steps: int = 5, features: int = 8):
    rng = np.random.default_rng(6)
    x = rng.normal(size=(n, steps, features)).astype("float32")
    return x, rng.normal(size=(n, 2)).astype("float32")


def _recurrent(layer, jit_compile: bool = False, masked: bool = False):
    x, y = _sequences()
    mask = [layers.Masking(-999.0)] if masked else []  # masks nothing
    model = keras.Sequential(
        [
            layers.Input((5, 8)),
            *mask,
            layer(16, name="rnn"),
            layers.Dense(2, name="head"),
        ]
    )
    return fit_model(model, x, y, jit_compile=jit_compile)


@case("dropin", layout=KERNELS)
def lstm():
    return _recurrent(layers.LSTM)


@case("dropin", layout=KERNELS)
def gru():
    return _recurrent(layers.GRU)


def _conv_fit(input_shape: tuple, *conv_layers, jit_compile: bool = False):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(16, *input_shape)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    pooling = {2: layers.GlobalAveragePooling1D, 3: layers.GlobalAveragePooling2D}
    pool = pooling.get(len(input_shape), layers.GlobalAveragePooling3D)
    model = keras.Sequential(
        [layers.Input(input_shape), *conv_layers, pool(), layers.Dense(2)]
    )
    return fit_model(model, x, y, jit_compile=jit_compile)


@case("dropin", layout={".*c1/kernel": (None, None, "model"), ".*c1/bias": ("model",)})
def conv1d_output_channels(jit_compile: bool = False):
    """Kernel and bias sharded on output channels: the next conv gets them all."""
    return _conv_fit(
        (9, 8),
        layers.Conv1D(16, 3, name="c1"),
        layers.Conv1D(8, 3, name="c2"),
        jit_compile=jit_compile,
    )


@case("dropin", layout={".*c1/kernel": ("model", None, None)})
def conv1d_kernel_axis(jit_compile: bool = False):
    return _conv_fit(
        (9, 8),
        layers.Conv1D(16, 4, name="c1"),
        layers.Conv1D(8, 3, name="c2"),
        jit_compile=jit_compile,
    )


@case("dropin", layout={".*c1/kernel": (None, None, None, "model", None)})
def conv3d_input_channels(jit_compile: bool = False):
    conv = layers.Conv3D(4, 2, name="c1")
    return _conv_fit((4, 5, 5, 4), conv, jit_compile=jit_compile)


@case("dropin", layout={".*c1/kernel": (None, None, "model", None)})
def depthwise_conv2d(jit_compile: bool = False):
    conv = layers.DepthwiseConv2D(3, name="c1")
    return _conv_fit((6, 6, 4), conv, jit_compile=jit_compile)


@case(
    "dropin",
    layout={
        ".*c1/depthwise_kernel": (None, None, "model", None),
        ".*c1/pointwise_kernel": (None, None, None, "model"),
    },
)
def separable_conv2d(jit_compile: bool = False):
    conv = layers.SeparableConv2D(8, 3, name="c1")
    return _conv_fit((6, 6, 4), conv, jit_compile=jit_compile)


@case("dropin", layout={".*c1/kernel": (None, None, "model", None)})
def conv2d_transpose(jit_compile: bool = False):
    conv = layers.Conv2DTranspose(6, 3, name="c1")
    return _conv_fit((5, 5, 4), conv, jit_compile=jit_compile)


def _causal_attention(jit_compile: bool = False):
    rng = np.random.default_rng(8)
    x = rng.normal(size=(16, 8, 16)).astype("float32")
    y = rng.normal(size=(16, 1)).astype("float32")
    inputs = layers.Input((8, 16))
    attended = layers.MultiHeadAttention(2, 8, name="mha")(
        inputs, inputs, use_causal_mask=True
    )
    pooled = layers.GlobalAveragePooling1D()(inputs + attended)
    model = keras.Model(inputs, layers.Dense(1, name="head")(pooled))
    return fit_model(model, x, y, jit_compile=jit_compile, sgd=True)


@case("dropin", layout=TRANSFORMER)
def mha_causal_mask():
    return _causal_attention()


@case("dropin", layout=MEGATRON)
def shuffled_dropout_fit():
    """``fit()`` as users call it: numpy input shuffled (the default), an
    unseeded Dropout on sharded activations, validation data. One process's
    epochs iterate a torch DataLoader: it permutes with a torch generator and
    draws a seed from torch's global one (twice an epoch), which the dropout
    reads; ModelParallel's walked numpy batches, permuted by numpy, drawing
    nothing. The ``data`` family iterates the same loader, so the batches,
    masks, losses and weights equal one process's. Upstream trains to other
    losses."""
    x, y = data()
    model = keras.Sequential(
        [
            layers.Input((16,)),
            layers.Dense(32, activation="relu", name="dense_1"),
            layers.Dropout(0.3),
            layers.Dense(4, name="dense_2"),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        validation_data=(x[:32], y[:32]),
    )
    return {
        "losses": history.history["loss"] + history.history["val_loss"],
        "weights": weights(model),
    }


@case("dropin_compiled", layout=KERNELS)
def lstm_compiled():
    """Compiled for real: its sharded kernels gathered once per call."""
    return with_plugin_warnings(_recurrent, layers.LSTM, jit_compile=True)


@case("dropin_compiled", layout=KERNELS, slow=True)  # the LSTM's path
def gru_compiled():
    return with_plugin_warnings(_recurrent, layers.GRU, jit_compile=True)


@case("dropin_compiled", layout=KERNELS, eager="generic RNN loop")
def masked_lstm_compiled():
    """A mask sends the LSTM to Keras's generic RNN loop, which torch cannot
    compile over DTensors: refused up front, as the model's graph shows the
    mask (warned), rather than after a failed trace as long as a compile."""
    return with_plugin_warnings(_recurrent, layers.LSTM, jit_compile=True, masked=True)


@case("dropin_compiled", layout=KERNELS, eager="generic RNN loop")
def simple_rnn_compiled():
    """Any other RNN runs the generic loop: refused up front (warned)."""
    return with_plugin_warnings(_recurrent, layers.SimpleRNN, jit_compile=True)


def _compiled_twin(eager, slow: bool = True) -> None:
    """Register ``eager``'s case again, with jit_compile=True, as NAME_compiled."""

    def run():
        return eager(jit_compile=True)

    run.__name__ = f"{eager.__name__}_compiled"
    case("dropin_compiled", layout=CASES[eager.__name__]["layout"], slow=slow)(run)


# Every conv runs eagerly in the default run; compiled, the kernel-axis Conv1D
# stands for them, the rest (the input-channel Conv2D below too) are slow.
_compiled_twin(conv1d_kernel_axis, slow=False)
for _eager in (
    conv1d_output_channels,
    conv3d_input_channels,
    depthwise_conv2d,
    separable_conv2d,
    conv2d_transpose,
):
    _compiled_twin(_eager)


@case("dropin_compiled", layout={".*c1/kernel": (None, None, "model", None)}, slow=True)
def conv2d_input_channels_compiled():
    return _conv_fit((6, 6, 4), layers.Conv2D(4, 3, name="c1"), jit_compile=True)


# The slow tier's: the compiled transformer of the parity group takes its path.
@case("dropin_compiled", layout=TRANSFORMER, slow=True)
def mha_causal_mask_compiled():
    return _causal_attention(jit_compile=True)


@case("dropin_compiled", layout=COLUMNS)
def unseeded_dropout_compiled():
    x, y = data()
    model = keras.Sequential(
        [
            layers.Input((16,)),
            layers.Dense(32, activation="relu", name="dense_1"),
            layers.Dropout(0.0),  # unseeded: the rate keeps parity checkable
            layers.Dense(4, name="dense_2"),
        ]
    )
    return fit_model(model, x, y, batch_size=16, jit_compile=True)


# ---------------------------------------------------------------- branches
# Gradient accumulation and EMA overwrites branch on the step count through
# Keras's ``ops.cond``; compiled, both branches run and torch.where keeps one.

BRANCHING = {
    "accumulate2_clipnorm_compiled": lambda: keras.optimizers.Adam(
        1e-2, gradient_accumulation_steps=2, clipnorm=0.5
    ),
    "accumulate3_global_clipnorm_compiled": lambda: keras.optimizers.SGD(
        0.05, momentum=0.9, gradient_accumulation_steps=3, global_clipnorm=0.5
    ),
    "ema_overwrite_compiled": lambda: keras.optimizers.Adam(
        1e-2, use_ema=True, ema_momentum=0.5, ema_overwrite_frequency=2
    ),
    # both conds in one step, weight decay inside the update branch (slow tier)
    "accumulate2_ema_overwrite3_compiled": lambda: keras.optimizers.AdamW(
        1e-2, gradient_accumulation_steps=2, use_ema=True, ema_overwrite_frequency=3
    ),
}


def _branching_case(name: str, factory) -> None:
    def run():
        import torch._dynamo.utils

        result = with_plugin_warnings(fit_mlp, factory(), jit_compile=True)
        breaks = torch._dynamo.utils.counters["graph_break"]
        result["graph_breaks"] = sum(breaks.values())
        return result

    run.__name__ = name
    # Adam's accumulation stands for every cond on the step count (the slow
    # tier's: SGD's accumulation, EMA overwrites, both conds at once).
    slow = name != "accumulate2_clipnorm_compiled"
    case("dropin_compiled", layout=COLUMNS, slow=slow)(run)


for _name, _factory in BRANCHING.items():
    _branching_case(_name, _factory)


@case("dropin_compiled", layout=BIASED)
def loss_scale_sgd_fp16_compiled():
    """``LossScaleOptimizer`` compiled: its ``cond`` on finite gradients (and
    the nested one on its growth counter) selects its branch (``optimizers``
    family), one graph, no break. Before, the first batch's compile failed
    ("expected example_value to be a FakeTensor, got DTensor") and the step
    ran eagerly, warned: 0 graphs."""
    import torch._dynamo.utils

    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.05))
        result = with_plugin_warnings(fit_mlp, optimizer, epochs=2, jit_compile=True)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    breaks = torch._dynamo.utils.counters["graph_break"]
    result["graph_breaks"] = sum(breaks.values())
    return result
