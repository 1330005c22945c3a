"""Scenario case: collectives per ModelParallel train step on two ranks,
for test_collectives.py.

Trains the benchmark's MLP and transformer block (Megatron layouts) eagerly
and with ``jit_compile=True``, and tiny keras-hub models eagerly (their
compiled steps are counted by the ``hub_compiled`` cases), and returns
collectives per step (counted with torch's profiler, as the benchmark does)
and the ops an eager step dispatches on DTensors (each costs DTensor's
dispatch); the runner adds the case's dynamo graphs (``dynamo_graphs``).
Compiled steps run the case's backend (``aot_eager``: the graph dynamo and
AOT autograd make, with the plugin's collectives in it, without code
generation; ``SCENARIO_COMPILE_BACKEND`` names another). One case in the
batch's launch, not a launch of its own: the counts need no fresh process,
each model sets its own distribution. The one-process run has nothing to
count.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import keras
import numpy
from scenario_kit import WORLD, DTensorOps, case

from keras_dtensor_fix.demo import set_model_parallel

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "tests"))
import bench_steps as bench  # noqa: E402  (collectives(), LAYOUTS, KERAS_MODELS)

from support import compiles_model_parallel  # noqa: E402


@case("collectives")
def collectives_per_step() -> dict:
    """Every model's collectives (and eager DTensor ops) per step, on (1, 2)."""
    return counts() if WORLD > 1 else {}


def dtensor_ops(step) -> int:
    """DTensor-dispatched ops in one call of ``step``."""
    with DTensorOps() as mode:
        step()
    return mode.count


def hub_counts(name: str) -> tuple[float, int] | None:
    """Collectives per eager step of a tiny keras-hub CausalLM (2 layers),
    ``"gemma"`` or ``"llama"``, sharded by its backbone's ``get_layout_map``
    on (1, 2), or of ``"gpt"``, keras_hub's TransformerDecoder blocks with a
    Megatron LayoutMap, and the ops a step dispatches on DTensors. None
    without keras-hub. (Their compiled steps: ``cases_hub.CountCollectives``.)"""
    if importlib.util.find_spec("keras_hub") is None:
        return None
    from cases_hub import GPT_LAYOUT, hub_layout, tiny_causal_lm, tiny_gpt

    if name == "gpt":
        set_model_parallel(GPT_LAYOUT)
    else:
        mesh = keras.distribution.distribution().device_mesh
        dist = keras.distribution.ModelParallel(
            layout_map=hub_layout(name)(mesh), batch_dim_name="batch"
        )
        dist.auto_shard_dataset = False
        keras.distribution.set_distribution(dist)
    keras.utils.set_random_seed(0)
    ids = numpy.random.default_rng(0).integers(1, 64, size=(4, 12)).astype("int32")
    y = numpy.roll(ids, -1, axis=1)
    if name == "gpt":
        model = tiny_gpt()
        x = ids
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    else:
        model = tiny_causal_lm(name)
        x = {"token_ids": ids, "padding_mask": numpy.ones_like(ids)}
        loss = None
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    for _ in range(2):
        model.train_on_batch(x, y)
    step = functools.partial(model.train_on_batch, x, y)
    return bench.collectives(step), dtensor_ops(step)


def counts() -> dict:
    """Every model's collectives (and eager DTensor ops) per step."""
    results = {}
    for model_name in ("mlp", "transformer"):
        set_model_parallel(bench.LAYOUTS[model_name])
        for config in ("eager", "compiled"):
            keras.utils.set_random_seed(0)
            model, x, y = bench.KERAS_MODELS[model_name](numpy, keras)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss="mse",
                jit_compile=config == "compiled",
            )
            for _ in range(2):
                model.train_on_batch(x, y)
            step = functools.partial(model.train_on_batch, x, y)
            results[f"{model_name}/{config}"] = bench.collectives(step)
            if config == "eager":
                results[f"{model_name}/dtensor_ops"] = dtensor_ops(step)
    # The compiled keras-hub steps are counted by their scenario cases
    # (cases_hub.CountCollectives), which compile them anyway.
    for name in ("gemma", "llama", "gpt"):
        counts = hub_counts(name)
        results[f"{name}/eager"] = None if counts is None else counts[0]
        results[f"{name}/dtensor_ops"] = None if counts is None else counts[1]
    results["compiles"] = compiles_model_parallel()
    return results
