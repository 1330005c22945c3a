"""Training scenarios run by the multi-process tests (and the demo).

Run as ``torchrun --nproc_per_node=2 scenarios.py GROUP OUT_DIR`` for the
sharded run, or ``python scenarios.py GROUP OUT_DIR`` for the single-process
reference. Each process writes ``OUT_DIR/GROUP.rank<R>.json``: for every case,
its losses, metrics, predictions and final weights (full values), or the error
it raised. The same seed and data feed both runs.

A case that fails on some ranks only would leave the others waiting in a
collective until the process group's timeout (30 minutes): after each case
every rank reports to the others through the launcher's store, and a rank
whose peers do not report within ``SCENARIO_PEER_WAIT`` seconds (default 120)
says which case and exits, which makes torchrun stop them all.

Compiled cases run torch.compile's ``aot_eager`` backend (dynamo, AOT
autograd and the plugin's traced paths, no code generation) unless registered
with ``inductor=True``: the cases where inductor's code generation is the
point (the toy MLP, a keras-hub LLM (Gemma), QwenMoe, which the warm-cache
test launches again, and the (2, 2) MLP), or when
``SCENARIO_COMPILE_BACKEND`` names another backend for every case.

Environment: ``SCENARIO_CASES`` (comma list) limits the cases run;
``SCENARIO_EXIT_PROMOTION=1`` exits Keras's promotion mode after
``set_distribution`` (to show what fails without the plugin);
``SCENARIO_NO_IMPLICIT_REPLICATION=1`` turns DTensor's implicit replication
off after it (to show what the plugin's switch fixes).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import traceback
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import layers, ops  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
SEED = 1234
PEER_WAIT = float(os.environ.get("SCENARIO_PEER_WAIT", "120"))
CASES: dict[str, dict[str, object]] = {}


def case(group: str, mesh: tuple[int, int] = (1, 2), **options: object):
    """Register a scenario function under ``group``."""

    def register(fn):
        CASES[fn.__name__] = {"fn": fn, "group": group, "mesh": mesh, **options}
        return fn

    return register


# ---------------------------------------------------------------- helpers


def data(n: int = 64, features: int = 16, outputs: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = rng.normal(size=(n, outputs)).astype("float32")
    return x, y


def rank_rows(array: np.ndarray, batch_size: int) -> np.ndarray:
    """This rank's rows of every batch (the per-process shard on a (2,1) mesh)."""
    if WORLD == 1:
        return array
    per = batch_size // WORLD
    batches = array.reshape(-1, WORLD, per, *array.shape[1:])
    return batches[:, RANK].reshape(-1, *array.shape[1:])


def mlp(units: int = 32, outputs: int = 4, features: int = 16, **dense_kwargs):
    return keras.Sequential(
        [
            layers.Input((features,)),
            layers.Dense(units, activation="relu", name="dense_1", **dense_kwargs),
            layers.Dense(units, activation="relu", name="dense_2", **dense_kwargs),
            layers.Dense(outputs, name="dense_3", **dense_kwargs),
        ]
    )


def weights(model) -> list:
    return [np.asarray(w, dtype="float64").tolist() for w in model.get_weights()]


def fit_mlp(optimizer, epochs: int = 3, batch_size: int = 16, **compile_kwargs):
    x, y = data()
    model = mlp()
    model.compile(optimizer=optimizer, loss="mse", **compile_kwargs)
    history = model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )
    return {"losses": history.history["loss"], "weights": weights(model)}


def distribute(mesh_shape: tuple[int, int], layout) -> None:
    """Set a ModelParallel distribution on ``mesh_shape`` (only when sharded).

    ``layout`` maps variable path regexes to axes, or is a function of the
    mesh that returns a LayoutMap (keras-hub's ``get_layout_map``).
    """
    if WORLD == 1:
        keras.distribution.set_distribution(None)
        return
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh(mesh_shape, ["batch", "model"], devices)
    if callable(layout):
        layout_map = layout(mesh)
    else:
        layout_map = keras.distribution.LayoutMap(mesh)
        for key, axes in (layout or {}).items():
            layout_map[key] = axes
    dist = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    dist.auto_shard_dataset = False
    keras.distribution.set_distribution(dist)
    if os.environ.get("SCENARIO_EXIT_PROMOTION") == "1":
        from keras.src.backend import distribution_lib

        distribution_lib.deactivate_dtensor_promotion()
    if os.environ.get("SCENARIO_NO_IMPLICIT_REPLICATION") == "1":
        from torch.distributed.tensor import DTensor

        DTensor._op_dispatcher._allow_implicit_replication = False


MEGATRON = {".*dense_1/kernel": (None, "model"), ".*dense_2/kernel": ("model", None)}
COLUMNS = {".*dense.*/kernel": (None, "model")}


# ---------------------------------------------------------------- optimizers

OPTIMIZERS = {
    "sgd_momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "adam_amsgrad": lambda: keras.optimizers.Adam(1e-2, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.01),
    "rmsprop_centered_momentum": lambda: keras.optimizers.RMSprop(
        1e-3, momentum=0.5, centered=True
    ),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(1e-2),
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "lion": lambda: keras.optimizers.Lion(1e-3),
}

OPTIONS = {
    "clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.5),
    "clipvalue": lambda: keras.optimizers.Adam(1e-2, clipvalue=0.01),
    "global_clipnorm": lambda: keras.optimizers.SGD(0.1, global_clipnorm=0.5),
    "weight_decay": lambda: keras.optimizers.SGD(0.05, weight_decay=0.05),
    "use_ema": lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.5),
    "gradient_accumulation": lambda: keras.optimizers.Adam(
        1e-2, gradient_accumulation_steps=2
    ),
    "lr_schedule": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5)
    ),
}


def _optimizer_case(name: str, factory, layout) -> None:
    def run():
        return fit_mlp(factory())

    run.__name__ = name
    case("optimizers", layout=layout)(run)


for _name, _factory in {**OPTIMIZERS, **OPTIONS}.items():
    _optimizer_case(_name, _factory, COLUMNS if _name != "adam" else MEGATRON)


@case("optimizers", layout=COLUMNS)
def loss_scale_bf16():
    keras.mixed_precision.set_dtype_policy("mixed_bfloat16")
    try:
        optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))
        return fit_mlp(optimizer)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


@case("optimizers", layout=MEGATRON)
def megatron_sgd():
    return fit_mlp(keras.optimizers.SGD(0.05))


# ---------------------------------------------------------------- data


@case("data", mesh=(2, 1), layout={}, per_rank=True)
def batch_axis_numpy():
    """(2,1): each rank feeds its half of every batch; equals the full batch."""
    return fit_rank_rows()


def fit_rank_rows(batch_ranks: int = WORLD, **compile_kwargs):
    """An Adam MLP fit on this rank's rows of every batch of 16, the batch
    split over ``batch_ranks`` processes (all of them by default)."""
    x, y = data()
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse", **compile_kwargs)
    history = model.fit(
        batch_rows(x, 16, batch_ranks),
        batch_rows(y, 16, batch_ranks),
        batch_size=16 // batch_ranks,
        epochs=3,
        shuffle=False,
        verbose=0,
    )
    return {"losses": history.history["loss"], "weights": weights(model)}


@case("data", mesh=(2, 1), layout={".*dense_1/kernel": (None, "model")}, per_rank=True)
def batch_axis_dataloader():
    x, y = data()
    x, y = rank_rows(x, 16), rank_rows(y, 16)
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(dataset, batch_size=16 // WORLD, shuffle=False)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(loader, epochs=3, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


@case("data", layout=COLUMNS)
def dataloader():
    x, y = data()
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=False)
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(loader, epochs=3, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


class _Batches(keras.utils.PyDataset):
    def __init__(self, x, y, batch_size):
        super().__init__()
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return len(self.x) // self.batch_size

    def __getitem__(self, index):
        rows = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[rows], self.y[rows]


@case("data", layout=COLUMNS)
def pydataset():
    x, y = data()
    model = mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    history = model.fit(_Batches(x, y, 16), epochs=3, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


@case("data", layout=COLUMNS)
def evaluate_predict_metrics():
    x, y = data()
    labels = (y[:, :1] > 0).astype("float32")
    model = mlp(outputs=1)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
        metrics=[
            keras.metrics.BinaryAccuracy(threshold=0.0),
            keras.metrics.AUC(name="auc", from_logits=True),
            keras.metrics.MeanSquaredError(name="mse"),
        ],
    )
    history = model.fit(x, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
    evaluation = model.evaluate(x, labels, batch_size=16, verbose=0, return_dict=True)
    predictions = model.predict(x, batch_size=16, verbose=0)
    return {
        "losses": history.history["loss"],
        "metrics": {k: float(v) for k, v in evaluation.items()},
        "predictions": np.asarray(predictions, dtype="float64").tolist(),
        "weights": weights(model),
    }


@case("data", layout=COLUMNS)
def sample_and_class_weight():
    x, y = data()
    labels = (y[:, 0] > 0).astype("int32")
    sample_weight = np.linspace(0.5, 1.5, len(x)).astype("float32")
    model = mlp(outputs=2)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    first = model.fit(
        x,
        labels,
        sample_weight=sample_weight,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    second = model.fit(
        x,
        labels,
        class_weight={0: 0.3, 1: 1.7},
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    return {
        "losses": first.history["loss"] + second.history["loss"],
        "weights": weights(model),
    }


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


TRANSFORMER = {
    ".*mha/query/kernel": (None, "model", None),
    ".*mha/key/kernel": (None, "model", None),
    ".*mha/value/kernel": (None, "model", None),
    ".*mha/attention_output/kernel": ("model", None, None),
    ".*ffn_1/kernel": (None, "model"),
    ".*ffn_2/kernel": ("model", None),
}


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
    return _fit(keras.Model(inputs, outputs), x, y)


# ---------------------------------------------------------------- custom loop


@case("custom", layout=MEGATRON)
def custom_training_loop():
    """keras.ops loss, torch autograd, optimizer.apply; plain and DTensor inputs."""
    from keras.src.backend.torch import distribution_lib

    x, y = data()
    model = mlp()
    model.build((None, 16))
    optimizer = keras.optimizers.Adam(1e-2)
    optimizer.build(model.trainable_variables)
    losses = []
    dist = keras.distribution.distribution()
    for step in range(8):
        xb = torch.from_numpy(x[(step % 4) * 16 : (step % 4 + 1) * 16])
        yb = torch.from_numpy(y[(step % 4) * 16 : (step % 4 + 1) * 16])
        if dist is not None and step % 2:
            # Half the steps feed distributed batches, half plain tensors.
            layout = dist.get_data_layout(tuple(xb.shape))
            xb = distribution_lib.distribute_data_input(xb, layout)
            yb = distribution_lib.distribute_data_input(yb, layout)
        prediction = model(xb)
        loss = ops.mean(ops.square(ops.subtract(prediction, yb)))
        losses.append(apply_step(model, optimizer, loss))
    return {"losses": losses, "weights": weights(model)}


def apply_step(model, optimizer, loss) -> float:
    """Backward, then the optimizer on the variables' gradients; the loss value."""
    model.zero_grad()
    loss.backward()
    grads = [v.value.grad for v in model.trainable_variables]
    with torch.no_grad():
        optimizer.apply(grads, model.trainable_variables)
    return float(ops.convert_to_numpy(loss))


@case("custom", layout=COLUMNS)
def save_load_weights():
    """Train, save_weights, load into a fresh model, predict; get_weights() too."""
    import tempfile

    result = fit_mlp(keras.optimizers.Adam(1e-2), epochs=1)
    trained = mlp()
    trained.build((None, 16))
    trained.set_weights([np.asarray(w, dtype="float32") for w in result["weights"]])
    # Every rank gathers the full values, so each writes a file of its own.
    path = os.path.join(tempfile.mkdtemp(), f"rank{RANK}.weights.h5")
    trained.save_weights(path)
    model = mlp()
    model.build((None, 16))
    model.load_weights(path)
    x, _ = data()
    return {
        "losses": result["losses"],
        "weights": weights(model),
        "predictions": np.asarray(model.predict(x, verbose=0), "float64").tolist(),
    }


# ---------------------------------------------------------------- compiled


@case("compiled", layout=MEGATRON, inductor=True)
def compiled_mlp():
    return fit_mlp(keras.optimizers.Adam(1e-2), jit_compile=True)


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


def _fit(model, x, y, *, batch_size: int = 8, jit_compile: bool = False, sgd=False):
    # SGD where a weight's true gradient is zero (an attention key bias):
    # Adam would scale its rounding noise up to full steps.
    optimizer = keras.optimizers.SGD(0.05) if sgd else keras.optimizers.Adam(1e-2)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


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
    return _fit(model, x, y, jit_compile=jit_compile)


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
    return _fit(model, x, y, jit_compile=jit_compile)


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
    return _fit(model, x, y, jit_compile=jit_compile, sgd=True)


@case("dropin", layout=TRANSFORMER)
def mha_causal_mask():
    return _causal_attention()


def _plugin_warnings(fn, *args, **kwargs) -> dict:
    """``fn``'s result with the plugin's warnings it raised."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    result["plugin_warnings"] = [
        str(w.message) for w in caught if "keras-dtensor-fix" in str(w.message)
    ]
    return result


@case("dropin_compiled", layout=KERNELS)
def lstm_compiled():
    """Compiled for real: its sharded kernels gathered once per call."""
    return _plugin_warnings(_recurrent, layers.LSTM, jit_compile=True)


@case("dropin_compiled", layout=KERNELS)
def gru_compiled():
    return _plugin_warnings(_recurrent, layers.GRU, jit_compile=True)


@case("dropin_compiled", layout=KERNELS, eager="torch.compile failed")
def masked_lstm_compiled():
    """A mask sends the LSTM to Keras's generic RNN loop, which torch cannot
    compile over DTensors: the step runs eagerly from its first batch (warned)."""
    return _plugin_warnings(_recurrent, layers.LSTM, jit_compile=True, masked=True)


@case("dropin_compiled", layout=KERNELS, eager="generic RNN loop")
def simple_rnn_compiled():
    """Any other RNN runs the generic loop: refused up front (warned)."""
    return _plugin_warnings(_recurrent, layers.SimpleRNN, jit_compile=True)


def _compiled_twin(eager) -> None:
    """Register ``eager``'s case again, with jit_compile=True, as NAME_compiled."""

    def run():
        return eager(jit_compile=True)

    run.__name__ = f"{eager.__name__}_compiled"
    case("dropin_compiled", layout=CASES[eager.__name__]["layout"])(run)


for _eager in (
    conv1d_output_channels,
    conv1d_kernel_axis,
    conv3d_input_channels,
    depthwise_conv2d,
    separable_conv2d,
    conv2d_transpose,
):
    _compiled_twin(_eager)


@case("dropin_compiled", layout={".*c1/kernel": (None, None, "model", None)})
def conv2d_input_channels_compiled():
    return _conv_fit((6, 6, 4), layers.Conv2D(4, 3, name="c1"), jit_compile=True)


@case("dropin_compiled", layout=TRANSFORMER)
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
    return _fit(model, x, y, batch_size=16, jit_compile=True)


# ---------------------------------------------------------------- keras-hub
# Tiny random causal LMs sharded by their own get_layout_map (2-D layouts that
# shard weights on the batch axis too), fed token ids: no preset download.


def tiny_causal_lm(kind: str):
    """A tiny random keras-hub CausalLM (2 layers, no preprocessor, no download)."""
    import keras_hub

    backbone, causal_lm = {
        "gemma": (keras_hub.models.GemmaBackbone, keras_hub.models.GemmaCausalLM),
        "llama": (keras_hub.models.LlamaBackbone, keras_hub.models.LlamaCausalLM),
        "qwen": (keras_hub.models.QwenBackbone, keras_hub.models.QwenCausalLM),
        "qwen_moe": (
            keras_hub.models.QwenMoeBackbone,
            keras_hub.models.QwenMoeCausalLM,
        ),
        "qwen3_moe": (
            keras_hub.models.Qwen3MoeBackbone,
            keras_hub.models.Qwen3MoeCausalLM,
        ),
    }[kind]
    extra = {
        "gemma": {"head_dim": 8},
        # 4 experts, 2 per token: top_k, one_hot and an add_loss in the router
        "qwen_moe": {
            "moe_intermediate_dim": 16,
            "shared_expert_intermediate_dim": 16,
            "num_experts": 4,
            "top_k": 2,
        },
        "qwen3_moe": {
            "head_dim": 8,
            "moe_intermediate_dim": 16,
            "num_experts": 4,
            "top_k": 2,
        },
    }.get(kind, {})
    model = backbone(
        vocabulary_size=64,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        **extra,
    )
    return causal_lm(backbone=model, preprocessor=None)


def hub_layout(kind: str):
    """``get_layout_map`` of ``kind``'s backbone, as a function of the mesh."""

    def layout(mesh):
        import keras_hub

        backbones = {
            "gemma": keras_hub.models.GemmaBackbone,
            "llama": keras_hub.models.LlamaBackbone,
            "qwen": keras_hub.models.QwenBackbone,
            "qwen_moe": keras_hub.models.QwenMoeBackbone,
            "qwen3_moe": keras_hub.models.Qwen3MoeBackbone,
        }
        return backbones[kind].get_layout_map(mesh)

    return layout


def batch_rows(array: np.ndarray, batch_size: int, batch_ranks: int) -> np.ndarray:
    """This rank's rows of every batch when ``batch_ranks`` split the batch axis."""
    if WORLD == 1 or batch_ranks == 1:
        return array
    index = RANK // (WORLD // batch_ranks)
    per = batch_size // batch_ranks
    batches = array.reshape(-1, batch_ranks, per, *array.shape[1:])
    return batches[:, index].reshape(-1, *array.shape[1:])


def fit_and_generate(kind: str, batch_ranks: int = 1, jit_compile: bool = False):
    """fit() on token ids, then greedy generate() (the KV-cache path)."""
    model = tiny_causal_lm(kind)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampler="greedy",  # top_k would draw per rank on a batch-split mesh
        jit_compile=jit_compile,
    )
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=(8, 12)).astype("int32")
    inputs = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    labels = np.roll(ids, -1, axis=1)
    history = model.fit(
        {k: batch_rows(v, 4, batch_ranks) for k, v in inputs.items()},
        batch_rows(labels, 4, batch_ranks),
        batch_size=4 // batch_ranks,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    prompt = {"token_ids": ids[:2].copy(), "padding_mask": np.zeros((2, 12), "int32")}
    prompt["padding_mask"][:, :5] = 1
    prompt["token_ids"][:, 5:] = 0
    tokens = model.generate(prompt, max_length=12, stop_token_ids=None)
    return {
        "losses": history.history["loss"],
        "weights": weights(model),
        "tokens": np.asarray(tokens["token_ids"]).tolist(),
    }


def _hub_case(group: str, kind: str, mesh: tuple[int, int]) -> None:
    def run():
        return fit_and_generate(kind, batch_ranks=mesh[0] if WORLD > 1 else 1)

    run.__name__ = f"{kind}_{mesh[0]}x{mesh[1]}"
    case(group, mesh=mesh, layout=hub_layout(kind), per_rank=mesh[0] > 1)(run)


for _kind in ("gemma", "llama", "qwen"):
    _hub_case("hub", _kind, (1, 2))
for _kind in ("gemma", "llama"):
    _hub_case("hub", _kind, (2, 1))
for _kind in ("gemma", "llama", "qwen"):
    _hub_case("hub4", _kind, (2, 2))


def _compiled(kind: str, batch_ranks: int = 1) -> dict:
    """jit_compile=True for real: dynamo graphs, no eager fallback (no warning).

    The one-process reference runs eagerly: the compiled ranks must equal it.
    """
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "gpt":
            result = fit_gpt(jit_compile=WORLD > 1, batch_ranks=batch_ranks)
        else:
            result = fit_and_generate(kind, batch_ranks, jit_compile=WORLD > 1)
    result["plugin_warnings"] = [
        str(w.message) for w in caught if "keras-dtensor-fix" in str(w.message)
    ]
    counters = torch._dynamo.utils.counters
    result["graph_breaks"] = sum(counters["graph_break"].values())
    result["compile_cache"] = {  # this launch's, every case so far
        **{k: v for k, v in counters["inductor"].items() if "fxgraph_cache" in k},
        **{k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    }
    return result


def _compiled_case(
    group: str, kind: str, mesh: tuple[int, int], inductor: bool = False
) -> None:
    def run():
        return _compiled(kind, batch_ranks=mesh[0] if WORLD > 1 else 1)

    run.__name__ = f"{kind}_{mesh[0]}x{mesh[1]}_compiled"
    options = {"layout": hub_layout(kind), "per_rank": mesh[0] > 1}
    case(group, mesh=mesh, inductor=inductor, **options)(run)


for _kind in ("gemma", "llama", "qwen"):
    _compiled_case("hub_compiled", _kind, (1, 2), inductor=_kind == "gemma")
for _kind in ("gemma", "llama"):
    _compiled_case("hub_compiled", _kind, (2, 1))
for _kind in ("gemma", "llama", "qwen"):
    _compiled_case("hub4_compiled", _kind, (2, 2))
for _kind in ("qwen_moe", "qwen3_moe"):
    _compiled_case("moe_compiled", _kind, (1, 2), inductor=_kind == "qwen_moe")


GPT_LAYOUT = {  # Megatron: column-parallel Q/K/V and FFN in, row-parallel out
    r".*self_attention/(query|key|value)/kernel": (None, "model", None),
    r".*self_attention/(query|key|value)/bias": ("model", None),
    r".*self_attention/attention_output/kernel": ("model", None, None),
    r".*feedforward_intermediate_dense/kernel": (None, "model"),
    r".*feedforward_intermediate_dense/bias": ("model",),
    r".*feedforward_output_dense/kernel": ("model", None),
    r".*lm_head/kernel": (None, "model"),
    r".*lm_head/bias": ("model",),
}


def tiny_gpt():
    """A GPT-style decoder from keras_hub.layers (causal self-attention)."""
    import keras_hub

    ids = keras.Input((12,), dtype="int32", name="token_ids")
    x = keras_hub.layers.TokenAndPositionEmbedding(64, 12, 32, name="embedding")(ids)
    for i in range(2):
        x = keras_hub.layers.TransformerDecoder(64, 4, name=f"decoder_{i}")(x)
    return keras.Model(ids, layers.Dense(64, name="lm_head")(x))


def fit_gpt(jit_compile: bool = False, batch_ranks: int = 1) -> dict:
    """:func:`tiny_gpt` trained for two epochs."""
    model = tiny_gpt()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        jit_compile=jit_compile,
    )
    tokens = np.random.default_rng(0).integers(1, 64, size=(8, 12)).astype("int32")
    labels = np.roll(tokens, -1, axis=1)
    return _fit_history(
        model,
        batch_rows(tokens, 4, batch_ranks),
        batch_rows(labels, 4, batch_ranks),
        batch_size=4 // batch_ranks,
    )


def _fit_history(model, x, y, *, batch_size: int) -> dict:
    history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


@case("hub_compiled", layout=GPT_LAYOUT)
def gpt_1x2_compiled():
    return _compiled("gpt")


@case("hub_compiled", mesh=(2, 1), layout=GPT_LAYOUT, per_rank=True)
def gpt_2x1_compiled():
    """The same decoder data-parallel: each process feeds its half of a batch."""
    return _compiled("gpt", batch_ranks=2 if WORLD > 1 else 1)


# ---------------------------------------------------------------- harness


@case("harness", layout=COLUMNS)
def one_rank_fails():
    """The last rank fails before a collective the others wait in."""
    if WORLD > 1 and RANK == WORLD - 1:
        raise RuntimeError("this rank fails alone")
    if WORLD > 1:
        torch.distributed.barrier()
    return {"losses": []}


# ---------------------------------------------------------------- runner


@contextlib.contextmanager
def compile_backend(backend: str):
    """``torch.compile`` (Keras's trainer calls it bare) defaults to ``backend``."""
    original = torch.compile

    def compile_with(*args, **kwargs):
        kwargs.setdefault("backend", backend)
        return original(*args, **kwargs)

    torch.compile = compile_with
    try:
        yield
    finally:
        torch.compile = original


def run_case(name: str) -> dict:
    spec = CASES[name]
    # Each case starts as a fresh script would: the trainer's step code is
    # shared by every model, and dynamo stops compiling a code object after
    # its recompile limit.
    torch._dynamo.reset()
    keras.utils.set_random_seed(SEED)
    distribute(spec["mesh"], spec.get("layout"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    backend = os.environ.get("SCENARIO_COMPILE_BACKEND") or (
        "inductor" if spec.get("inductor") else "aot_eager"
    )
    try:
        with compile_backend(backend):
            result = spec["fn"]()
        # How many dynamo graphs the case compiled (0: it ran eagerly).
        result["dynamo_graphs"] = (
            torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        )
        promotion = [
            type(m).__name__
            for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack()
        ]
        result["dispatch_modes"] = promotion
        return result
    except Exception as err:  # reported, compared by the tests
        return {
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
        }
    finally:
        keras.distribution.set_distribution(None)


def wait_for_peers(name: str, result: dict) -> None:
    """Every rank finished ``name``, or this process ends the run naming it."""
    store = torch.distributed.distributed_c10d._get_default_store()
    store.set(f"scenario/{name}/{RANK}", "error" if "error" in result else "ok")
    keys = [f"scenario/{name}/{rank}" for rank in range(WORLD)]
    try:
        store.wait(keys, datetime.timedelta(seconds=PEER_WAIT))
    except Exception:  # the store's timeout error differs by torch release
        missing = [key for key in keys if not store.check([key])]
        print(
            f"scenario {name!r}: rank {RANK} finished it "
            f"({'failed' if 'error' in result else 'ok'}) but {missing} did not "
            f"within {PEER_WAIT:.0f} s: they wait in a collective this rank "
            f"skipped. This rank's result:\n{result.get('traceback', result)}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)


def main(argv: list[str]) -> int:
    group, out_dir = argv[0], argv[1]
    keras.config.disable_traceback_filtering()
    if WORLD > 1:
        keras.distribution.initialize()
    only = [c for c in os.environ.get("SCENARIO_CASES", "").split(",") if c]
    names = [n for n, spec in CASES.items() if spec["group"] == group]
    if only:
        names = [n for n in names if n in only]
    results = {}
    for name in names:
        results[name] = run_case(name)
        if WORLD > 1:
            wait_for_peers(name, results[name])
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{group}.rank{RANK}.json"), "w") as handle:
        json.dump({"world": WORLD, "cases": results}, handle)
    if WORLD > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import leave  # skips a teardown that can abort: see leave()

    leave(main(sys.argv[1:]))
