"""What the training scenarios share: the case registry, data, models, layouts.

``scenarios.py`` runs the cases; ``cases_*.py`` register them here with
:func:`case`, by group. See ``scenarios.py`` for how they run.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import layers, ops  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))
SEED = 1234
CASES: dict[str, dict[str, object]] = {}


def case(group: str, mesh: tuple[int, int] = (1, 2), **options: object):
    """Register a scenario function under ``group``.

    ``slow=True``: a variant whose path another case of the default run
    already takes (another mesh, a sibling model or layer); it runs only where
    the tests select it (``nox -s full``), see ``support.scenario_params``.
    ``upstream_slow=True``: its upstream run (``KERAS_DTENSOR_FIX=0``) fails
    as another default case's does, and only the slow tier launches it.
    """

    def register(fn):
        if fn.__name__ in CASES:  # a second case of one name would hide the first
            raise ValueError(f"scenario case {fn.__name__!r} is registered twice")
        CASES[fn.__name__] = {"fn": fn, "group": group, "mesh": mesh, **options}
        return fn

    return register


# ---------------------------------------------------------------- helpers


class DTensorOps(TorchDispatchMode):
    """Counts the aten ops called with a DTensor among their arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(a, DTensor) for a in tree_leaves((args, kwargs))):
            self.count += 1
        return func(*args, **kwargs)


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


def batch_rows(array: np.ndarray, batch_size: int, batch_ranks: int) -> np.ndarray:
    """This rank's rows of every batch when ``batch_ranks`` split the batch axis."""
    if WORLD == 1 or batch_ranks == 1:
        return array
    index = RANK // (WORLD // batch_ranks)
    per = batch_size // batch_ranks
    batches = array.reshape(-1, batch_ranks, per, *array.shape[1:])
    return batches[:, index].reshape(-1, *array.shape[1:])


TRANSFORMER = {
    ".*mha/query/kernel": (None, "model", None),
    ".*mha/key/kernel": (None, "model", None),
    ".*mha/value/kernel": (None, "model", None),
    ".*mha/attention_output/kernel": ("model", None, None),
    ".*ffn_1/kernel": (None, "model"),
    ".*ffn_2/kernel": ("model", None),
}


def apply_step(model, optimizer, loss) -> float:
    """Backward, then the optimizer on the variables' gradients; the loss value."""
    model.zero_grad()
    loss.backward()
    grads = [v.value.grad for v in model.trainable_variables]
    with torch.no_grad():
        optimizer.apply(grads, model.trainable_variables)
    return float(ops.convert_to_numpy(loss))


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


def fit_model(
    model, x, y, *, batch_size: int = 8, jit_compile: bool = False, sgd=False
):
    # SGD where a weight's true gradient is zero (an attention key bias):
    # Adam would scale its rounding noise up to full steps.
    optimizer = keras.optimizers.SGD(0.05) if sgd else keras.optimizers.Adam(1e-2)
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    history = model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return {"losses": history.history["loss"], "weights": weights(model)}


def plugin_warnings(caught) -> list[str]:
    """The plugin's warnings among ``caught`` (``warnings.catch_warnings``'s
    records): its own, and torch's that name its code (dynamo warned of an
    ``lru_cache`` the plugin called in a traced step: a user sees it too)."""
    names = ("keras-dtensor-fix", "keras_dtensor_fix")
    return [str(w.message) for w in caught if any(n in str(w.message) for n in names)]


def with_plugin_warnings(fn, *args, **kwargs) -> dict:
    """``fn(*args, **kwargs)``'s result dict with the plugin's warnings it raised
    (``plugin_warnings``)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    result["plugin_warnings"] = plugin_warnings(caught)
    return result
