"""The cases of ``no_distribution.py``, as plain data (no Keras import).

``test_no_distribution.py`` reads them at collection, the runner builds them.
"""

from __future__ import annotations

from typing import Any

#: Every optimizer Keras ships, then one per feature, on the optimizer it is
#: usually met with, then every feature at once ("features").
OPTIMIZER_NAMES = (
    "sgd", "adam", "adamw", "adamax", "adagrad", "adadelta", "rmsprop", "nadam",
    "ftrl", "lion", "lamb", "adafactor", "loss_scale", "muon", "schedule_free",
    "multi", "clipnorm", "global_clipnorm", "clipvalue", "ema", "accumulate",
    "weight_decay", "schedule", "features",
)  # fmt: skip

#: Optimizers an older Keras lacks: name -> the class in keras.optimizers.
OPTIONAL = {
    "muon": "Muon",
    "schedule_free": "ScheduleFreeAdamW",
    "multi": "MultiOptimizer",
}

#: name -> (optimizer, mode, options); mode: eager, jit (dynamo's eager backend)
#: or inductor. Every optimizer and feature eagerly; compiling costs seconds
#: a case, so compiled cases are few: accumulation (its step failed to
#: compile) and a custom train_step with every feature, steps_per_execution
#: and the callbacks.
CASES: dict[str, tuple[str, str, dict[str, Any]]] = {
    **{f"{name}-eager": (name, "eager", {}) for name in OPTIMIZER_NAMES},
    "adam-eager-spe": ("adam", "eager", {"steps_per_execution": 2}),
    "adam-eager-custom": ("adam", "eager", {"kind": "custom"}),
    "ema-eager-callbacks": ("ema", "eager", {"callbacks": True}),
    "accumulate-jit": ("accumulate", "jit", {}),
    "features-jit-custom": (
        "features",
        "jit",
        {"steps_per_execution": 2, "callbacks": True, "kind": "custom"},
    ),
    "accumulate-inductor": ("accumulate", "inductor", {}),
    # keras-hub's generate() on a model compiled with jit_compile=True: eager
    # on torch upstream; the generate family compiles it only when sharded
    "gemma-generate-jit": ("generate", "jit", {"kind": "generate"}),
}

#: Cases the test leaves out unless asked (inductor's code generation).
SLOW = ("accumulate-inductor",)
