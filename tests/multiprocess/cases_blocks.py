"""Scenarios: ``KERAS_DTENSOR_FIX_COMPILE=blocks`` (each repeated block
compiled once for all its instances, the step eager around them)."""

from __future__ import annotations

import contextlib
import os

import keras
import numpy as np
import torch
from cases_hub import (
    GPT_LAYOUT,
    fit_and_generate,
    fit_gpt,
    hub_layout,
    tiny_gpt,
    watched,
)
from scenario_kit import case, weights


@contextlib.contextmanager
def blocks_mode(mode: str | None = "blocks"):
    """The mode a user sets in the environment (None: the default), and what
    torch.compile got: the qualified name of each function compiled, with
    how many times its compiled function was called, and how many of those
    calls skipped dynamo's guards."""
    compiled: dict[str, int] = {}
    unguarded: dict[str, int] = {}
    original = torch.compile

    def compile_and_name(function=None, *args, **kwargs):
        name = getattr(function, "__qualname__", repr(function))
        compiled.setdefault(name, 0)
        made = original(function, *args, **kwargs)

        def counted(*call_args, **call_kwargs):
            compiled[name] += 1
            if torch._dynamo.eval_frame._stance.skip_guard_eval_unsafe:
                unguarded[name] = unguarded.get(name, 0) + 1
            return made(*call_args, **call_kwargs)

        return counted

    saved = os.environ.pop("KERAS_DTENSOR_FIX_COMPILE", None)
    if mode is not None:
        os.environ["KERAS_DTENSOR_FIX_COMPILE"] = mode
    torch.compile = compile_and_name
    try:
        yield compiled, unguarded
    finally:
        torch.compile = original
        os.environ.pop("KERAS_DTENSOR_FIX_COMPILE", None)
        if saved is not None:
            os.environ["KERAS_DTENSOR_FIX_COMPILE"] = saved


@contextlib.contextmanager
def eager_f():
    """How many Megatron "f" ops ran eagerly (outside any graph)."""
    from keras_dtensor_fix.dtensor import local

    made = []
    saved = vars(local._ReduceGradient)["forward"]
    forward = local._ReduceGradient.forward

    def counted(ctx, value):
        made.append(True)
        return forward(ctx, value)

    local._ReduceGradient.forward = staticmethod(counted)
    try:
        yield made
    finally:
        local._ReduceGradient.forward = saved


@contextlib.contextmanager
def eager_metric_updates():
    """How many times the compiled metrics were updated eagerly (outside any
    graph): a compiled region's update runs Python only while it is traced."""
    from keras.src.trainers.compile_utils import CompileMetrics

    made = []
    saved = vars(CompileMetrics)["update_state"]

    def counted(self, *args, **kwargs):
        if not torch.compiler.is_compiling():
            made.append(True)
        return saved(self, *args, **kwargs)

    CompileMetrics.update_state = counted
    try:
        yield made
    finally:
        CompileMetrics.update_state = saved


def _blocks(fit, mode: str | None = "blocks") -> dict:
    from keras_dtensor_fix.compiled import blocks

    with blocks_mode(mode) as (compiled, unguarded), eager_f() as made:
        with eager_metric_updates() as updated:
            result = watched(fit)
    result["why"] = list(blocks.LAST)
    # each function compiled, and how often its compiled function ran
    result["compiled"] = sorted(compiled)
    result["calls"] = compiled
    result["eager_metric_updates"] = len(updated)
    result["eager_f"] = len(made)
    # calls that skipped dynamo's guards (their results, checked against one
    # process, are the skipped calls')
    result["unguarded"] = unguarded
    return result


@case("blocks", layout=GPT_LAYOUT)
def gpt_4_layers_blocks():
    """Four keras-hub TransformerDecoder blocks, Megatron's layout by hand,
    in the default mode (``auto``: a model with repeated blocks)."""
    return _blocks(lambda: fit_gpt(True, depth=4, accuracy=True), mode=None)


# The slow tier's: the default run's hub models nest their blocks too.
@case("blocks", layout=GPT_LAYOUT, slow=True, upstream_slow=True)
def gpt_blocks_loss_scaled():
    """The compiled update where Keras's optimizer branches: a loss-scaled
    Adam accumulating two batches selects its ``cond`` branches on DTensors
    (the ``optimizers`` family) in one region; the default case's Adam
    compiles per block. The model is nested as a keras-hub causal LM (a
    backbone with a final norm, the head after it): the tail's region opens
    the backbone and runs its final norm. Upstream fails as on
    ``gpt_4_layers_blocks``."""
    inner = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=2)
    optimizer = keras.optimizers.LossScaleOptimizer(inner)
    return _blocks(lambda: fit_gpt(True, optimizer=optimizer, nested=True), mode=None)


@case("blocks", layout=GPT_LAYOUT, slow=True, upstream_slow=True)
def gpt_blocks_adamw():
    """The update per block where Keras's eager ``apply`` does more around it:
    AdamW's weight decay and ``clipnorm`` run on the DTensors (a norm over
    the whole gradients), then the update runs per block on local shards
    (``compiled/update_groups.py``). Upstream fails as on
    ``gpt_4_layers_blocks``."""
    optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.1, clipnorm=0.5)
    return _blocks(lambda: fit_gpt(True, optimizer=optimizer), mode=None)


# The slow tier's: its regions are gpt_4_layers_blocks's, its whole-step
# evaluation the compiled parity cases'.
@case("blocks", layout=GPT_LAYOUT, slow=True)
def gpt_blocks_evaluate():
    """The default mode's evaluation and prediction: two TransformerDecoder
    blocks train block by block, validation, ``evaluate()`` and ``predict()``
    compile their steps whole (no backward to save). Dropout in every block
    (``dropout=0.1``: attention and feed-forward, unseeded): each mask is
    drawn by one opaque op of the block's graph when it runs, as one process
    draws it eagerly (the ``random`` family), and each epoch iterates one
    process's ``DataLoader`` (the ``data`` family). Upstream fails
    in the dropout ("aten.bernoulli_.float: in-place operations that require
    placement changes are not supported")."""

    def fit() -> dict:
        model = tiny_gpt(2, dropout=0.1)
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=True,
        )
        tokens = np.random.default_rng(0).integers(1, 64, size=(8, 12))
        x, y = tokens.astype("int32"), np.roll(tokens, -1, axis=1).astype("int32")
        history = model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            shuffle=False,
            validation_data=(x, y),
            verbose=0,
        )
        evaluated = model.evaluate(x, y, batch_size=4, verbose=0)
        logits = model.predict(x, batch_size=4, verbose=0)
        return {
            "losses": history.history["loss"] + history.history["val_loss"],
            "evaluated": [float(evaluated)],
            "predicted": np.asarray(logits, "float64").ravel()[:64].tolist(),
            "weights": weights(model),
        }

    return _blocks(fit, mode=None)


def _hub_blocks(kind: str, **options) -> None:
    def run():
        return _blocks(
            lambda: fit_and_generate(kind, jit_compile=True, compiled_generation=False)
        )

    run.__name__ = f"{kind}_blocks"
    run.__doc__ = f"""{kind}'s CausalLM, its own get_layout_map (2-D layouts), then
    greedy generation (eager: a compiled token step is the generate family's)."""
    case("blocks", layout=hub_layout(kind), **options)(run)


_hub_blocks("llama", slow=True)  # the GPT case's path, with a get_layout_map
# Gemma under aot_eager fails in torch's backward graph (a size-1 dim's stride
# differs between fake and real tensors and CPU cat's memory format follows
# it); inductor, which users get from jit_compile=True, compiles it right.
_hub_blocks("gemma", inductor=True, slow=True)
# Experts routed with top_k and one_hot; the router's balancing loss comes out
# of each block's region through add_loss.
_hub_blocks("qwen_moe", slow=True)
