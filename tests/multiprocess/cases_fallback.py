"""Scenario cases: local fast paths defeated on purpose.

Generation's (the ``hub`` group), then training's: the ``leaves`` and
``layers`` families' local calls (the ``dropin`` group, upstream pinned in
``test_dropin.py``) and blocks mode's compiled blocks (the ``blocks`` group,
``test_blocks.py``); each section says what its cases do.

Eager sharded generation runs each decoder block on local tensors where
``decoder.plan`` proves Megatron's layout, and the whole one-token call where
``causal_lm.plan`` fits (``causal_lm.run``). Each case below makes one of
them fail where it cannot see it coming (its plan raises, or its first run
does): the family must warn once, naming the cause, and generate as
upstream's DTensor path does, one process's tokens (``test_hub.py``,
``test_generation_fast_paths_fall_back``). The compiled token step's own
fallbacks run on one process (``tests/test_generate.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
from cases_hub import GPT_LAYOUT, hub_layout, short_prompts, tiny_causal_lm
from scenario_kit import case, plugin_warnings, with_plugin_warnings

#: case name -> the fragment each process's warning must hold
FALLBACKS: dict[str, str] = {}


def _broken(*args, **kwargs):
    raise RuntimeError("defeated on purpose")


def _uncompilable(cls: type) -> Callable:
    return _broken


def _generate_with(module: str, name: str) -> dict:
    """Gemma's greedy tokens (twice) with ``module.name`` raising."""
    from keras_dtensor_fix.generation import causal_lm, decoder
    from keras_dtensor_fix.generation import tokens as token_step

    owner = {"causal_lm": causal_lm, "decoder": decoder, "tokens": token_step}[module]
    original: Callable = getattr(owner, name)
    setattr(owner, name, _uncompilable if module == "tokens" else _broken)
    try:
        import keras

        keras.utils.set_random_seed(1)
        model = tiny_causal_lm("gemma")
        model.compile(sampler="greedy", jit_compile=module == "tokens")
        prompt = short_prompts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens = model.generate(prompt, max_length=12, stop_token_ids=None)
            again = model.generate(prompt, max_length=12, stop_token_ids=None)
    finally:
        setattr(owner, name, original)
    return {
        "tokens": np.asarray(tokens["token_ids"]).tolist(),
        "tokens_again": np.asarray(again["token_ids"]).tolist(),
        "plugin_warnings": plugin_warnings(caught),
    }


def _fallback_case(module: str, name: str, expected: str) -> None:
    def run() -> dict:
        return _generate_with(module, name)

    run.__name__ = f"gemma_1x2_{module}_{name.lstrip('_')}_raises"
    FALLBACKS[run.__name__] = expected
    # upstream cannot generate on (1, 2) at all (test_upstream_hub)
    case("hub", layout=hub_layout("gemma"), upstream_slow=True)(run)


# decoder.plan raises: every block on DTensors (the whole call needs them all)
_fallback_case("decoder", "plan", "decoder.plan raised (RuntimeError")
# causal_lm.plan raises: the blocks local, the rest of the token on DTensors
_fallback_case("causal_lm", "plan", "causal_lm.plan raised (RuntimeError")
# causal_lm.run raises on the first token: its check keeps block by block
_fallback_case("causal_lm", "run", "did not match (RuntimeError")
# jit_compile=True, its compiled token call raising (nothing compiles): from
# the second token on, where the first token's whole call proved local and
# the cache is this rank's heads, the eager call runs inside causal_lm.run
_fallback_case("tokens", "_compiled", "runs eagerly: its compiled token step")
# decoder.run raises on a block's first call: its check keeps it on DTensors
_fallback_case("decoder", "run", "did not match (RuntimeError")


# ------------------------------------------------ training's local fast paths
# Each case below defeats one fast path of a training step on purpose, where
# it cannot see it coming: its recognition raises, or accepts what it must
# refuse (silently other numbers), or its compiled block fails. Every process
# must warn once per object, naming the cause, and train as upstream's path
# does: one process's losses and weights (test_dropin.py's
# test_local_fast_paths_fall_back, test_blocks.py's test_blocks_fall_back).

#: case name -> (a fragment every warning holds, one some warning holds)
LOCAL_FALLBACKS: dict[str, tuple[str, str]] = {}

#: The leaf model's layout: ``cols`` and ``probs`` column-parallel.
LEAF_LAYOUT = {
    ".*cols/kernel": (None, "model"),
    ".*cols/bias": ("model",),
    ".*probs/kernel": (None, "model"),
    ".*probs/bias": ("model",),
    ".*rows/kernel": ("model", None),
    ".*out/kernel": (None, None),
}


def _fit_leaf_model() -> dict:
    """cases_layers.leaf_layers_local_and_not's model with a column-parallel
    ``probs``, whose softmax reads across its split features: leaves and
    dense layers local where each rank's piece computes alone, and not where
    it would read across a split (``softmax_split``, ``probs``)."""
    import keras
    from keras import layers
    from scenario_kit import fit_model

    inputs = layers.Input((6, 16))
    split = layers.Dense(32, name="cols")(inputs)  # local, features split
    probs = layers.Dense(32, activation="softmax", name="probs")(inputs)
    heads = layers.Reshape((6, 4, 8))(split)
    heads = layers.Softmax(axis=1, name="softmax_seq")(heads)
    across = layers.Softmax(axis=-1, name="softmax_split")(split)
    h = layers.Add()([layers.Reshape((6, 32))(heads), across, probs])
    h = layers.LayerNormalization(name="ln_split")(h)
    h = layers.Dense(16, name="rows")(h)
    h = layers.LayerNormalization(name="ln_whole")(h)
    outputs = layers.Dense(4, name="out")(layers.GlobalAveragePooling1D()(h))
    rng = np.random.default_rng(8)
    x = rng.normal(size=(32, 6, 16)).astype("float32")
    y = rng.normal(size=(32, 4)).astype("float32")
    return fit_model(keras.Model(inputs, outputs), x, y)


def _defeated(module: str, name: str, replacement: Callable) -> Callable:
    """The leaf model's training with ``keras_dtensor_fix.<module>.<name>``
    replaced (restored after)."""

    def run() -> dict:
        import importlib

        owner = importlib.import_module(f"keras_dtensor_fix.{module}")
        original = getattr(owner, name)
        setattr(owner, name, replacement(original))
        try:
            return with_plugin_warnings(_fit_leaf_model)
        finally:
            setattr(owner, name, original)

    return run


def _raising(original: Callable) -> Callable:
    return _broken


def _accepting_all_axes(original: Callable) -> Callable:
    """``planner.region`` told the computation reads across no dim: a
    softmax over the split features runs on each shard alone."""

    def region(values, mixes):
        return original(values, frozenset())

    return region


def _all_elementwise(original: Callable) -> Callable:
    """``activation_scope`` calling every activation elementwise: ``cols``'
    softmax runs on each rank's half of the features."""
    return lambda activation: "elementwise"


def _local_case(name: str, run: Callable, every: str, some: str) -> None:
    run.__name__ = name
    LOCAL_FALLBACKS[name] = (every, some)
    case("dropin", layout=LEAF_LAYOUT)(run)


def _register_local_cases() -> None:
    leaf, dense = "the leaves family's local call on", "local dense call on"
    # the recognition raises: every leaf layer calls its own on DTensors
    _local_case(
        "leaves_region_raises",
        _defeated("patches.leaves", "local_region", _raising),
        leaf,
        "ln_whole raised (RuntimeError: defeated on purpose)",
    )
    # the recognition accepts what reads across a split: the first call's
    # check against DTensor's path catches the other numbers
    _local_case(
        "leaves_region_accepts_split",
        _defeated("dtensor.planner", "region", _accepting_all_axes),
        leaf,
        "softmax_split did not match DTensor's path",
    )
    _local_case(
        "dense_local_raises",
        _defeated("patches.layers", "local_dense", _raising),
        dense,
        "cols raised (RuntimeError: defeated on purpose)",
    )
    _local_case(
        "dense_activation_misread",
        _defeated("patches.layers", "activation_scope", _all_elementwise),
        dense,
        "probs did not match DTensor's path",
    )


_register_local_cases()


# ------------------------------------------------------------- blocks mode
#: case name -> the fragments each process's warnings must hold, in order
#: (the blocks group: test_blocks.py's test_blocks_fall_back)
BLOCK_FALLBACKS: dict[str, tuple[str, ...]] = {}


def _compiler_raises() -> Callable:
    """A torch.compile backend that fails on every graph (dynamo raises
    ``BackendCompilerFailed``, one of its own errors)."""

    def backend(graph, example_inputs):
        raise RuntimeError("defeated on purpose")

    return backend


def _backward_raises() -> Callable:
    """AOT autograd with its forward as traced and a backward that raises
    when it runs: a compiled block failing at run time, inside torch's
    runner of its graph."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop

    def backward(graph, example_inputs):
        def run(args):
            raise RuntimeError("defeated on purpose in backward")

        run._boxed_call = True
        return run

    return aot_autograd(fw_compiler=boxed_nop, bw_compiler=backward)


def _blocks_case(
    name: str, backend: Callable[[], Callable], expected: tuple[str, ...]
) -> None:
    def run() -> dict:
        import torch
        from cases_blocks import blocks_mode
        from cases_hub import fit_gpt, watched

        from keras_dtensor_fix.compiled import region

        original, chosen = torch.compile, backend()

        def compile_with(function=None, *args, **kwargs):
            kwargs["backend"] = chosen
            return original(function, *args, **kwargs)

        torch.compile = compile_with
        try:
            with blocks_mode():
                return watched(lambda: fit_gpt(True, depth=2))
        finally:
            torch.compile = original
            region.forget()  # the class this case failed compiles again later

    run.__name__ = name
    BLOCK_FALLBACKS[name] = expected
    case("blocks", layout=GPT_LAYOUT, slow="backward" in name)(run)


# the block's compilation fails: that class runs its own call (blocks.py);
# the tail's and the optimizer update's too: they run eagerly (tail.py,
# update_groups.py)
_blocks_case(
    "gpt_blocks_compile_raises",
    _compiler_raises,
    (
        "torch.compile failed on TransformerDecoder "
        "(RuntimeError: defeated on purpose)",
        "torch.compile failed on the layers after",
        "torch.compile failed on the update of Adam",
    ),
)
# the compiled block's backward fails in the first step: the step runs again
# eagerly (the compile family's fallback), as upstream runs it (the slow tier's)
_blocks_case(
    "gpt_blocks_backward_raises",
    _backward_raises,
    ("defeated on purpose in backward",),
)
