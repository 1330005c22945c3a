"""One process, no distribution: every case trains and prints what it got.

Run as ``python no_distribution.py OUT_DIR [CASE ...]``, once with the plugin
and once with ``KERAS_DTENSOR_FIX=0``; ``test_no_distribution.py`` compares
the two case by case. The last line of stdout is one JSON document: per case
its losses, evaluation, predictions, weights, dynamo's new graphs and graph
breaks, the plugin's warnings, and the error it raised (or ``None``).

Compiled cases run dynamo with ``aot_eager`` (AOT autograd's forward and
backward graphs, no inductor code generation: the plugin's changes are in
what dynamo traces, not in how a graph is lowered) unless a case names a
backend; ``torch._dynamo.reset()`` between cases keeps each case's graphs its
own (Keras's step closures share one code object, and its cache limit would
otherwise send later cases to eager).
"""

from __future__ import annotations

import json
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import keras
import numpy as np
import torch
from no_distribution_cases import CASES, OPTIMIZER_NAMES, OPTIONAL, SLOW
from torch._dynamo.utils import counters

import keras_dtensor_fix

OPT = keras.optimizers
SCHEDULES = keras.optimizers.schedules
_compile = torch.compile
BACKEND = ["eager"]


def _compile_with_backend(*args: Any, **kwargs: Any) -> Any:
    kwargs.setdefault("backend", BACKEND[0])
    return _compile(*args, **kwargs)


torch.compile = _compile_with_backend  # Keras calls torch.compile(step)


class CustomStep(keras.Model):
    """A ``train_step`` of the guide "Customizing what happens in fit()" (torch)."""

    def train_step(self, data):
        x, y = data
        self.zero_grad()
        y_pred = self(x, training=True)
        loss = self.compute_loss(y=y, y_pred=y_pred)
        loss.backward()
        trainable = list(self.trainable_weights)
        grads = [v.value.grad for v in trainable]
        with torch.no_grad():
            self.optimizer.apply(grads, trainable)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class NumpyScale(keras.layers.Layer):
    """A numpy scalar converted in ``call`` (keras-hub's attention scale).

    Upstream's conversion breaks dynamo's graph; the plugin's ``convert``
    family traces it, so it would change the graphs if it ran unsharded.
    """

    def call(self, x):
        return x * keras.ops.convert_to_tensor(np.sqrt(np.float32(0.25)))


def model(kind: str = "seq") -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8,))
    scaled = NumpyScale()(inputs) if kind == "custom" else inputs
    hidden = keras.layers.Dense(4, activation="relu", name="hidden")(scaled)
    outputs = keras.layers.Dense(2, name="head")(hidden)
    cls = CustomStep if kind == "custom" else keras.Model
    return cls(inputs, outputs)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 8)).astype("float32")
    return x, (x[:, :2] * 0.5 + 0.1).astype("float32")


def _multi() -> Any:
    mapping = OPT.OptimizerMap(default_optimizer=OPT.SGD(0.05))
    mapping["head"] = OPT.Adam(0.01)
    return OPT.MultiOptimizer(mapping)


def _decay() -> Any:
    opt = OPT.AdamW(0.01, weight_decay=0.1)
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


#: name -> a new optimizer (each feature on the optimizer it is usually met with).
OPTIMIZERS: dict[str, Callable[[], Any]] = {
    "sgd": lambda: OPT.SGD(0.05, momentum=0.9, nesterov=True),
    "adam": lambda: OPT.Adam(0.01),
    "adamw": lambda: OPT.AdamW(0.01),
    "adamax": lambda: OPT.Adamax(0.01),
    "adagrad": lambda: OPT.Adagrad(0.05),
    "adadelta": lambda: OPT.Adadelta(1.0),
    "rmsprop": lambda: OPT.RMSprop(0.01),
    "nadam": lambda: OPT.Nadam(0.01),
    "ftrl": lambda: OPT.Ftrl(0.05),
    "lion": lambda: OPT.Lion(0.001),
    "lamb": lambda: OPT.Lamb(0.01),
    "adafactor": lambda: OPT.Adafactor(0.01),
    "loss_scale": lambda: OPT.LossScaleOptimizer(OPT.SGD(0.05)),
    "muon": lambda: OPT.Muon(0.01),
    "schedule_free": lambda: OPT.ScheduleFreeAdamW(0.01),
    "multi": _multi,
    "clipnorm": lambda: OPT.Adam(0.01, clipnorm=0.1),
    "global_clipnorm": lambda: OPT.Adam(0.01, global_clipnorm=0.1),
    "clipvalue": lambda: OPT.Adam(0.01, clipvalue=0.01),
    "ema": lambda: OPT.Adam(0.01, use_ema=True, ema_overwrite_frequency=3),
    "accumulate": lambda: OPT.Adam(0.01, gradient_accumulation_steps=3),
    "weight_decay": _decay,
    "schedule": lambda: OPT.SGD(SCHEDULES.ExponentialDecay(0.1, 2, 0.5)),
}


def callbacks(out: Path, optimizer: Any) -> list[Any]:
    cb = keras.callbacks
    found = [
        cb.SwapEMAWeights(swap_on_epoch=True),
        cb.ModelCheckpoint(str(out / "best.weights.h5"), save_weights_only=True),
        cb.BackupAndRestore(str(out / "backup")),
        cb.EarlyStopping(monitor="loss", patience=5),
        cb.TerminateOnNaN(),
        cb.CSVLogger(str(out / "log.csv")),
    ]
    if not isinstance(optimizer._learning_rate, SCHEDULES.LearningRateSchedule):
        # A schedule's learning rate cannot be set (Keras raises).
        found.append(cb.ReduceLROnPlateau(monitor="loss", patience=1, min_delta=10.0))
    return found


def _features() -> Any:
    """Every optimizer feature at once, for the compiled case (one compile)."""
    opt = OPT.AdamW(
        SCHEDULES.ExponentialDecay(0.01, 2, 0.5),
        weight_decay=0.1,
        clipnorm=0.5,
        use_ema=True,
        ema_overwrite_frequency=3,
    )
    opt.exclude_from_weight_decay(var_names=["bias"])
    return opt


OPTIMIZERS["features"] = _features
assert set(OPTIMIZERS) == set(OPTIMIZER_NAMES)


def _floats(values: Any) -> list[float]:
    return [float(v) for v in np.asarray(values, dtype="float64").ravel()]


def _plugin_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message)[:300] for w in caught if "dtensor" in str(w.message).lower()]


def _new_breaks(before: dict[str, int]) -> dict[str, int]:
    """Dynamo's graph breaks since ``before``, by the first line of their reason."""
    new: dict[str, int] = {}
    for reason, count in counters["graph_break"].items():
        if count > before.get(reason, 0):
            line = reason.splitlines()[0][:200]
            new[line] = new.get(line, 0) + count - before.get(reason, 0)
    return new


class _Done(Exception):
    """A case that reported without training."""


def _generate() -> dict[str, Any]:
    """A tiny keras-hub Gemma, ``jit_compile=True``, greedy tokens twice."""
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GemmaBackbone(
        vocabulary_size=64,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=16,
        intermediate_dim=32,
        head_dim=8,
    )
    lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    lm.compile(sampler="greedy", jit_compile=True)
    ids = np.zeros((2, 10), "int32")
    ids[:, :4] = 5
    prompt = {"token_ids": ids, "padding_mask": ids > 0}
    tokens = [lm.generate(prompt, stop_token_ids=None)["token_ids"] for _ in "ab"]
    first, second = (_floats(t) for t in tokens)
    return {
        "loss": first,
        "evaluate": second,
        "predict": [],
        "iterations": 0,
        "weights": [_floats(w) for w in lm.get_weights()],
    }


def run_case(name: str, out: Path) -> dict[str, Any]:
    optimizer, mode, options = CASES[name]
    torch._dynamo.reset()
    BACKEND[0] = "inductor" if mode == "inductor" else "eager"
    graphs = counters["stats"]["unique_graphs"]
    breaks = dict(counters["graph_break"])
    result: dict[str, Any] = {"error": None}
    start, cpu = time.perf_counter(), time.process_time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if options.get("kind") == "generate":
                result.update(_generate())
                raise _Done
            m = model(options.get("kind", "seq"))
            opt = OPTIMIZERS[optimizer]()
            m.compile(
                optimizer=opt,
                loss="mse",
                metrics=["mae"],
                jit_compile=mode != "eager",
                steps_per_execution=options.get("steps_per_execution", 1),
            )
            x, y = data()
            folder = out / name
            folder.mkdir(parents=True, exist_ok=True)
            history = m.fit(
                x,
                y,
                batch_size=8,
                epochs=2,
                shuffle=False,
                verbose=0,
                callbacks=callbacks(folder, opt) if options.get("callbacks") else None,
            )
            result["loss"] = _floats(history.history["loss"])
            result["evaluate"] = _floats(m.evaluate(x, y, batch_size=8, verbose=0))
            result["predict"] = _floats(m.predict(x[:8], batch_size=8, verbose=0))
            result["weights"] = [_floats(w) for w in m.get_weights()]
            result["iterations"] = int(m.optimizer.iterations.numpy())
        except _Done:
            pass
        except Exception as exc:  # noqa: BLE001 - the report is the point
            result["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
    result["graphs"] = counters["stats"]["unique_graphs"] - graphs
    result["graph_breaks"] = _new_breaks(breaks)
    result["plugin_warnings"] = _plugin_warnings(caught)
    result["seconds"] = round(time.perf_counter() - start, 2)
    result["cpu_seconds"] = round(time.process_time() - cpu, 2)
    return result


def main(argv: list[str]) -> None:
    out = Path(argv[0])
    names = argv[1:] or [name for name in CASES if name not in SLOW]
    missing = {n for n, cls in OPTIONAL.items() if not hasattr(OPT, cls)}
    results = {
        name: run_case(name, out) for name in names if CASES[name][0] not in missing
    }
    report = {"active": keras_dtensor_fix.is_active(), "cases": results}
    sys.stdout.flush()
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
