"""The patch families: one row each, the only registry (standard library only).

A row names the family (what ``KERAS_DTENSOR_FIX_DISABLE`` takes), the kinds of Keras
module it patches (:mod:`.targets`) and its implementation under
:mod:`keras_dtensor_fix.patches`, imported with the first of those modules."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One patch family."""

    name: str
    #: Kinds of :data:`~keras_dtensor_fix.engine.targets.MODULES` it patches.
    kinds: tuple[str, ...]
    #: What it fixes, in one line (for the reader of this table).
    summary: str
    #: Its module under ``keras_dtensor_fix.patches`` (default: ``name``).
    implementation: str = ""
    #: Applied only under Keras's torch backend with distribution support.
    gated: bool = True
    #: Import its modules as soon as Keras is imported. Keras imports some
    #: only when first used (a torch optimizer, when one is built): their
    #: patches would land late, and ``status`` would not see them.
    preload: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "implementation", self.implementation or self.name)


FAMILIES: tuple[Family, ...] = (
    Family(
        "optimizers",
        (
            "optimizers",
            "parallel_optimizer",
            "base_optimizer",
            "loss_scale_optimizer",
            "core",
        ),
        "optimizer steps on aligned gradients, shard-wise",
        preload=True,
    ),
    Family(
        "numpy",
        ("numpy",),
        "keras.ops numpy functions on DTensors and plain tensors (op handlers)",
        implementation="numpy_ops",
    ),
    Family(
        "data",
        ("distribution_lib", "trainer"),
        "batches in: distribute_data_input, per-step distribution, predict gather",
    ),
    Family(
        "metrics",
        ("trainer",),
        "metric results summed over the batch axis with one all-reduce",
    ),
    Family(
        "convert",
        ("core",),
        "convert_to_numpy gathers; convert_to_tensor traces numpy values",
    ),
    Family(
        "promotion",
        ("distribution_lib",),
        "DTensor implicit replication instead of Keras's promotion mode",
    ),
    Family(
        "variables",
        ("core", "distribution_lib"),
        "unsharded variables as Replicate DTensors; layout and mesh caches",
    ),
    Family(
        "compile",
        ("trainer", "layer_base"),
        "jit_compile=True compiles ModelParallel steps (or says why not)",
    ),
    Family(
        "compile_cache",
        ("dynamo_utils", "inductor_codecache"),
        "warm compile caches: numpy operators (Gemma), device meshes (QwenMoe)",
    ),
    Family(
        "ops",
        ("ops",),
        "nn/math/linalg/image ops, convolutions, attention, slice_update",
    ),
    Family("random", ("random",), "seeded dropout on DTensor activations"),
    Family(
        "replicated",
        ("loss_and_metrics",),
        "losses and metric updates on local tensors when all is replicated",
    ),
    Family(
        "layers",
        ("dense_layers",),
        "Dense and EinsumDense on local shards (Megatron layouts)",
    ),
    Family(
        "leaves",
        ("layer_base",),
        "layers without sharded weights (norms, rotary) on local tensors",
    ),
    Family(
        "rnn",
        ("rnn",),
        "LSTM/GRU: sharded kernels gathered once per call (compiles right)",
    ),
    Family(
        "generate",
        ("causal_lm",),
        "keras-hub generate() compiled per token when jit_compile=True",
    ),
    Family(
        "layouts",
        ("hub_backbone",),
        "get_layout_map(mesh) for keras-hub causal LM backbones without one",
    ),
    Family(
        "restarts",
        ("rendezvous", "elastic_agent"),
        "torchrun restarts: each attempt's process group its own store keys",
        # torch's, not Keras's: a script may start its group before Keras.
        gated=False,
    ),
    Family(
        "install_check",
        ("distribution_api",),
        "a ModelParallel script on a Keras without it warns with the fix",
        # The gate is closed on exactly the builds it warns about.
        gated=False,
    ),
    Family(
        "resume",
        ("epoch_iterator",),
        "fit resumed inside an epoch skips the batches a checkpoint holds",
    ),
    Family(
        "saving",
        ("saving", "backup_and_restore", "file_utils"),
        "one path on every process: one writer, atomic; BackupAndRestore",
    ),
)


def names() -> tuple[str, ...]:
    """Every family's name, in table order."""
    return tuple(family.name for family in FAMILIES)
