"""Scenarios: every optimizer and its options, data feeds, custom loops."""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import ops  # noqa: E402
from scenario_kit import (  # noqa: E402
    COLUMNS,
    MEGATRON,
    RANK,
    WORLD,
    apply_step,
    case,
    data,
    fit_mlp,
    fit_rank_rows,
    mlp,
    rank_rows,
    weights,
)

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
