"""Scenarios: keras-hub causal LMs (Gemma, Llama, Qwen, MoE) and the GPT decoder."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from keras import layers  # noqa: E402
from scenario_kit import (  # noqa: E402
    WORLD,
    DTensorOps,
    batch_rows,
    case,
    plugin_warnings,
    weights,
    with_plugin_warnings,
)

# ---------------------------------------------------------------- keras-hub
# Tiny random causal LMs sharded by their own get_layout_map (2-D layouts that
# shard weights on the batch axis too), fed token ids: no preset download.


def tiny_causal_lm(kind: str, layers: int = 2):
    """A tiny random keras-hub CausalLM (``layers`` decoder blocks, no
    preprocessor, no download)."""
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
        # TransformerDecoder blocks, biases
        "gpt2": (keras_hub.models.GPT2Backbone, keras_hub.models.GPT2CausalLM),
    }[kind]
    heads = {"num_query_heads": 4, "num_key_value_heads": 2}
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
        # an unseeded Dropout (GPT-2's default 0.1) draws per process
        "gpt2": {"num_heads": 4, "max_sequence_length": 16, "dropout": 0.0},
    }.get(kind, heads)
    if kind != "gpt2":
        extra = {**heads, **extra}
    model = backbone(
        vocabulary_size=64,
        num_layers=layers,
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


class CountCollectives(keras.callbacks.Callback):
    """Collectives per step of ``fit()``'s last epoch, counted with torch's
    profiler as ``benchmarks/bench_steps.py`` counts them (test_collectives.py
    bounds it). It adds no step: another call of the compiled step (a
    ``train_on_batch``, whose data has another structure) would compile the
    model again."""

    def __init__(self) -> None:
        super().__init__()
        self.per_step, self._profile, self._steps, self._last = None, None, 0, False

    def on_epoch_begin(self, epoch, logs=None):
        self._last = epoch == self.params["epochs"] - 1

    def on_train_batch_begin(self, batch, logs=None):
        if self._last and self._profile is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            self._profile = torch.profiler.profile(activities=activities)
            self._profile.__enter__()

    def on_train_batch_end(self, batch, logs=None):
        if self._profile is not None:
            self._steps += 1

    def on_epoch_end(self, epoch, logs=None):
        if self._profile is None:
            return
        self._profile.__exit__(None, None, None)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        from bench_steps import collective_events

        # Less the one all-gather in which the processes agree on the next
        # epoch's data (checks.feeds): Keras makes that epoch's iterator as
        # this one ends, and the agreement runs there, not at its first batch,
        # so that a process Keras stops without fetching (steps_per_epoch
        # beyond its data) meets the others' exchange instead of hanging them.
        self.per_step = (collective_events(self._profile) - 1) / self._steps


def _generation_state(model) -> list:
    """What generate() may change for one call and must put back: each
    weight's value object, each layer's own ``call`` and integer attributes
    (head counts)."""
    state = [id(v._value) for v in model.weights]
    for layer in model._flatten_layers():
        own = vars(layer)
        state.append(
            ("call" in own, sorted((k, v) for k, v in own.items() if type(v) is int))
        )
    return state


def fit_and_generate(
    kind: str,
    batch_ranks: int = 1,
    jit_compile: bool = False,
    collectives=False,
    compiled_generation: bool = True,
    layers: int = 2,
):
    """fit() on token ids, then greedy generate() (the KV-cache path); with
    ``collectives``, the last epoch's collectives per step
    (:class:`CountCollectives`). A jit_compile=True model generates compiled
    (the ``generate`` family) unless ``compiled_generation`` is False: then it
    is set back to eager first, as a user would (``model.jit_compile = False``),
    which spares the suite a second compile where training is the point.
    Eager: also DTensor-dispatched ops per token (a second greedy call), and
    where every process holds every row, a seeded top-k sampler's tokens."""
    import keras_hub

    model = tiny_causal_lm(kind, layers)
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
    counter = CountCollectives()
    history = model.fit(
        {k: batch_rows(v, 4, batch_ranks) for k, v in inputs.items()},
        batch_rows(labels, 4, batch_ranks),
        batch_size=4 // batch_ranks,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[counter] if collectives else [],
    )
    if not compiled_generation:
        model.jit_compile = False
    prompt = {"token_ids": ids[:2].copy(), "padding_mask": np.zeros((2, 12), "int32")}
    prompt["padding_mask"][:, :5] = 1
    prompt["token_ids"][:, 5:] = 0
    before = _generation_state(model)
    tokens = model.generate(prompt, max_length=12, stop_token_ids=None)
    result = {
        "losses": history.history["loss"],
        "weights": weights(model),
        "tokens": np.asarray(tokens["token_ids"]).tolist(),
        "restored": _generation_state(model) == before,
    }
    if not model.jit_compile:  # a dispatch mode would stop a compiled step
        count = DTensorOps()
        with count:
            again = model.generate(prompt, max_length=12, stop_token_ids=None)
        # 7 new tokens; the prompt's pass counts with them
        result["dtensor_ops_per_token"] = count.count / 7
        result["tokens_again"] = np.asarray(again["token_ids"]).tolist()
    if batch_ranks == 1 and not jit_compile:  # processes sharing rows draw alike
        model.compile(sampler=keras_hub.samplers.TopKSampler(k=8, seed=42))
        drawn = model.generate(prompt, max_length=12, stop_token_ids=None)
        result["top_k_tokens"] = np.asarray(drawn["token_ids"]).tolist()
        # Stopped at a token the draw made: the sampler's stop test and the
        # output mask (on plain tensors where the whole token call is local).
        stop = (int(result["top_k_tokens"][0][7]),)
        stopped = model.generate(prompt, max_length=12, stop_token_ids=stop)
        result["stopped"] = [
            np.asarray(stopped[k]).tolist() for k in ("token_ids", "padding_mask")
        ]
    if collectives:
        result["collectives"] = counter.per_step
    return result


def _hub_case(group: str, kind: str, mesh: tuple[int, int], slow: bool = False) -> None:
    def run():
        return fit_and_generate(kind, batch_ranks=mesh[0] if WORLD > 1 else 1)

    run.__name__ = f"{kind}_{mesh[0]}x{mesh[1]}"
    # Upstream fails (2, 1) where it fails (1, 2), after training Gemma
    # through its per-op DTensor path for half a minute: the slow tier's.
    options = {"per_rank": mesh[0] > 1, "upstream_slow": mesh[0] > 1}
    case(group, mesh=mesh, layout=hub_layout(kind), slow=slow, **options)(run)


for _kind in ("gemma", "llama", "qwen"):
    _hub_case("hub", _kind, (1, 2))
# On (2, 1) Llama stands for the three (Qwen is its layers with biases).
for _kind in ("gemma", "llama", "qwen"):
    _hub_case("hub", _kind, (2, 1), slow=_kind != "llama")
for _kind in ("gemma", "llama", "qwen"):
    _hub_case("hub4", _kind, (2, 2))


def short_prompts() -> dict:
    """Two prompts of 5 tokens, padded to 12 (``generate(max_length=12)``)."""
    prompt = {"token_ids": np.zeros((2, 12), "int32")}
    prompt["token_ids"][:, :5] = [[3, 9, 27, 14, 5], [8, 1, 60, 33, 2]]
    prompt["padding_mask"] = prompt["token_ids"] > 0
    return prompt


@case("hub", layout=hub_layout("gemma"))
def gemma_1x2_heads_miscounted():
    """Generation's safety net: without ``query_head_dim_normalize`` (Gemma 2's
    setting) Gemma's query scale reads ``hidden_dim // num_query_heads``;
    with ``hidden_dim``
    dropped from the plugin's head table its blocks' local calls scale
    queries wrongly (no error: a silently wrong result), the first call's
    check finds it and they generate on DTensors: the same tokens, a warning."""
    import warnings

    from keras_dtensor_fix.hub import generation

    heads = generation.ATTENTION_HEADS
    name = next(k for k in heads if k.endswith("GemmaAttention"))
    counts = heads[name]
    heads[name] = tuple(c for c in counts if c != "hidden_dim")
    keras.utils.set_random_seed(1)
    model = tiny_causal_lm("gemma")
    for block in model.backbone.transformer_layers:  # GemmaDecoderBlock sets True
        block.attention.query_head_dim_normalize = False
    model.compile(sampler="greedy")
    prompt = short_prompts()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens = model.generate(prompt, max_length=12, stop_token_ids=None)
    finally:
        heads[name] = counts
    return {
        "tokens": np.asarray(tokens["token_ids"]).tolist(),
        "plugin_warnings": plugin_warnings(caught),
    }


def watched(fit) -> dict:
    """``fit()``'s result with the plugin's warnings during it and dynamo's
    graph breaks (the case's: counters are cleared per case)."""
    result = with_plugin_warnings(fit)
    result["graph_breaks"] = sum(torch._dynamo.utils.counters["graph_break"].values())
    return result


#: Decoder blocks in the compiled keras-hub cases (and ``cases_generate``'s).
#: Dynamo traces each block again, and one block runs every op and layout a
#: second one would (QwenMoe: the router, top_k, one_hot, the experts and the
#: balancing loss): the eager cases keep 2 blocks, and compiling repeated
#: blocks once is the ``blocks`` group's (4 layers).
COMPILED_LAYERS = 1


def _compiled(kind: str, batch_ranks: int = 1, layers: int = COMPILED_LAYERS) -> dict:
    """jit_compile=True for real: dynamo graphs, no eager fallback (no warning).

    The one-process reference runs eagerly: the compiled ranks must equal it,
    their greedy tokens too. Generation compiles too (a graph per token step)
    for the kinds in :data:`COMPILED_GENERATION`; the others generate eagerly.
    On a (1, 2) mesh the compiled step's collectives are counted too, during
    ``fit()``'s last epoch, for test_collectives.py: the suite compiles each
    model once.
    """
    count = WORLD > 1 and batch_ranks == 1
    if kind == "gpt":
        result = watched(
            lambda: fit_gpt(True, batch_ranks, collectives=count, depth=layers)
        )
    else:
        result = watched(
            lambda: fit_and_generate(
                kind,
                batch_ranks,
                True,
                collectives=count,
                compiled_generation=kind in COMPILED_GENERATION,
                layers=layers,
            )
        )
    counters = torch._dynamo.utils.counters
    result["compile_cache"] = {  # this case's
        **{k: v for k, v in counters["inductor"].items() if "fxgraph_cache" in k},
        **{k: v for k, v in counters["aot_autograd"].items() if "cache" in k},
    }
    return result


#: The kinds whose compiled cases generate compiled too: Llama (on (1, 2) by
#: default; (2, 1) in the slow tier, (2, 2) in tests4) and Qwen (slow tier).
#: The others generate eagerly after compiled training (a second compile of
#: each would cost the default run a minute or more); every kind generates
#: compiled without training in ``cases_generate.py``.
COMPILED_GENERATION = ("llama", "qwen")


def _compiled_case(
    group: str,
    kind: str,
    mesh: tuple[int, int],
    inductor: bool = False,
    slow: bool = False,
    layers: int = COMPILED_LAYERS,
) -> None:
    def run():
        return _compiled(kind, batch_ranks=mesh[0] if WORLD > 1 else 1, layers=layers)

    run.__name__ = f"{kind}_{mesh[0]}x{mesh[1]}_compiled"
    options = {"layout": hub_layout(kind), "per_rank": mesh[0] > 1}
    case(group, mesh=mesh, inductor=inductor, slow=slow, **options)(run)


# A compiled keras-hub case traces for most of a minute on 2 cores. The default
# run compiles one: Gemma (inductor) on (1, 2); the batch-split compiled step
# is the compiled_batch_axis toy's. Llama, GPT and Qwen (Llama's layers with
# biases) on (1, 2), the MoE models (QwenMoe with inductor, launched again
# warm; Qwen3Moe) and Gemma, Llama, Qwen and GPT on (2, 1) are the slow tier's
# (nox -s full).
for _kind in ("gemma", "llama", "qwen"):
    _compiled_case(
        "hub_compiled", _kind, (1, 2), inductor=_kind == "gemma", slow=_kind != "gemma"
    )
for _kind in ("gemma", "llama", "qwen"):
    _compiled_case("hub_compiled", _kind, (2, 1), slow=True)
for _kind in ("gemma", "llama", "qwen"):
    _compiled_case("hub4_compiled", _kind, (2, 2))
for _kind in ("qwen_moe", "qwen3_moe"):
    _compiled_case(
        "moe_compiled",
        _kind,
        (1, 2),
        inductor=_kind == "qwen_moe",
        slow=True,
    )


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


@case("hub", layout={k: v for k, v in GPT_LAYOUT.items() if "lm_head" not in k})
def gpt2_1x2():
    """keras-hub's GPT-2, Megatron's layout by hand (it has no get_layout_map):
    column-parallel Q/K/V and FFN in with their biases, row-parallel out."""
    return fit_and_generate("gpt2")


def tiny_gpt(depth: int = 2, nested: bool = False, dropout: float = 0.0):
    """A GPT-style decoder from keras_hub.layers (causal self-attention);
    ``nested``: as a keras-hub causal LM, a backbone model (the blocks and a
    final norm) and the head after it; ``dropout``: each block's rate."""
    import keras_hub

    ids = keras.Input((12,), dtype="int32", name="token_ids")
    x = keras_hub.layers.TokenAndPositionEmbedding(64, 12, 32, name="embedding")(ids)
    for i in range(depth):
        x = keras_hub.layers.TransformerDecoder(
            64, 4, dropout=dropout, name=f"decoder_{i}"
        )(x)
    if nested:
        x = layers.LayerNormalization(name="final_norm")(x)
        x = keras.Model(ids, x, name="backbone")(ids)
    return keras.Model(ids, layers.Dense(64, name="lm_head")(x))


def fit_gpt(
    jit_compile: bool = False,
    batch_ranks: int = 1,
    collectives=False,
    depth: int = 2,
    accuracy: bool = False,
    optimizer=None,
    nested: bool = False,
):
    """:func:`tiny_gpt` trained for two epochs (with ``collectives``,
    counting the last one's: :class:`CountCollectives`; with ``accuracy``,
    the last epoch's accuracy among the results; ``optimizer``: Adam's)."""
    model = tiny_gpt(depth, nested)
    model.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
        jit_compile=jit_compile,
    )
    tokens = np.random.default_rng(0).integers(1, 64, size=(8, 12)).astype("int32")
    labels = np.roll(tokens, -1, axis=1)
    x, y = batch_rows(tokens, 4, batch_ranks), batch_rows(labels, 4, batch_ranks)
    counter = CountCollectives()
    history = model.fit(
        x,
        y,
        batch_size=4 // batch_ranks,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[counter] if collectives else [],
    )
    result = {"losses": history.history["loss"], "weights": weights(model)}
    if accuracy:
        accuracies = history.history["sparse_categorical_accuracy"]
        result["metrics"] = {"accuracy": accuracies[-1]}
    if collectives:
        result["collectives"] = counter.per_step
    return result


@case("hub_compiled", layout=GPT_LAYOUT, slow=True)
def gpt_1x2_compiled():
    return _compiled("gpt")


@case("hub_compiled", mesh=(2, 1), layout=GPT_LAYOUT, per_rank=True, slow=True)
def gpt_2x1_compiled():
    """The same decoder data-parallel: each process feeds its half of a batch."""
    return _compiled("gpt", batch_ranks=2 if WORLD > 1 else 1)
