"""Scenarios: models no layout was written for, sharded by the planner's.

Each case's layout is ``keras_dtensor_fix.auto_layout_map(build, mesh)``,
planned inside ``distribute`` after the case's seed is set: the model built
next must initialize as one process's does (the planner puts Keras's names
and random states back). Each trains two epochs, evaluates and predicts;
each process also reports the bytes of its weights' shards against the full
weights'.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from keras import layers  # noqa: E402
from scenario_kit import WORLD, batch_rows, case, mlp, weights  # noqa: E402

import keras_dtensor_fix  # noqa: E402

BATCH = 8


def planned(build, sample_input=None):
    """The case's layout: the planner's, for the model ``build()`` returns."""

    def layout(mesh):
        return keras_dtensor_fix.auto_layout_map(build, mesh, sample_input)

    return layout


def transformer():
    """keras.io's transformer classifier, small: one block, mean pooled."""
    inputs = keras.Input((8, 16))
    x = layers.MultiHeadAttention(num_heads=4, key_dim=8, name="mha")(inputs, inputs)
    x = layers.LayerNormalization(name="ln_1")(inputs + x)
    y = layers.Dense(64, activation="relu", name="ffn_1")(x)
    y = layers.Dense(16, name="ffn_2")(y)
    x = layers.LayerNormalization(name="ln_2")(x + y)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(4, name="head")(x))


class Block(layers.Layer):
    """A custom residual MLP block: two weights of its own, no Dense."""

    def __init__(self, hidden: int, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hidden = hidden

    def build(self, shape) -> None:
        self.w_in = self.add_weight((shape[-1], self.hidden), name="w_in")
        self.w_out = self.add_weight((self.hidden, shape[-1]), name="w_out")

    def call(self, x):
        h = keras.ops.gelu(keras.ops.matmul(x, self.w_in))
        return x + keras.ops.matmul(h, self.w_out)


class Subclassed(keras.Model):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = [Block(64, name=f"block_{i}") for i in range(2)]
        self.out = layers.Dense(4, name="out")

    def call(self, x):
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def convnet():
    return keras.Sequential(
        [
            layers.Input((8, 8, 3)),
            layers.Conv2D(8, 3, activation="relu", name="conv"),
            layers.Flatten(),
            layers.Dense(64, activation="relu", name="fc_1"),
            layers.Dense(4, name="fc_2"),
        ]
    )


def mixer():
    """An MLP-Mixer block: token mixing across patches, channel mixing."""
    inputs = keras.Input((8, 16))
    x = layers.Permute((2, 1))(inputs)
    x = layers.Dense(32, activation="gelu", name="token_1")(x)
    x = layers.Dense(8, name="token_2")(x)
    x = inputs + layers.Permute((2, 1))(x)
    y = layers.Dense(64, activation="gelu", name="channel_1")(x)
    x = x + layers.Dense(16, name="channel_2")(y)
    x = layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, layers.Dense(4, name="head")(x))


#: The tiny config of keras-hub's BERT and BART.
TEXT = {
    "vocabulary_size": 64,
    "num_layers": 2,
    "num_heads": 4,
    "hidden_dim": 32,
    "intermediate_dim": 64,
    "max_sequence_length": 16,
    "dropout": 0.0,
}


def bert():
    import keras_hub

    backbone = keras_hub.models.BertBackbone(**TEXT)
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=4, preprocessor=None, dropout=0.0
    )


def vit():
    import keras_hub

    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3),
        patch_size=4,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        mlp_dim=64,
        # An attention key bias has no true gradient (softmax cancels it):
        # Adam would scale its rounding noise up to full steps.
        use_mha_bias=False,
    )
    return keras_hub.models.ViTImageClassifier(
        backbone, num_classes=4, preprocessor=None
    )


def bart():
    """keras-hub's BART, the seq2seq backbone that trains fastest on CPU
    (T5 takes minutes to compile one step), as its Seq2SeqLM."""
    import keras_hub

    backbone = keras_hub.models.BartBackbone(**TEXT)
    return keras_hub.models.BartSeq2SeqLM(backbone, preprocessor=None)


def gemma():
    from cases_hub import tiny_causal_lm

    return tiny_causal_lm("gemma")


def _features(shape):
    rng = np.random.default_rng(0)
    return rng.normal(size=(32, *shape)).astype("float32")


def _tokens():
    rng = np.random.default_rng(0)
    ids = rng.integers(1, 64, size=(32, 12)).astype("int32")
    return {
        "token_ids": ids,
        "segment_ids": np.zeros_like(ids),
        "padding_mask": np.ones_like(ids),
    }


def _next_tokens(prefixes=("",)):
    """Token ids under each of ``prefixes``, with next-token labels."""
    rng = np.random.default_rng(0)
    x = {}
    for prefix in prefixes:
        ids = rng.integers(1, 64, size=(32, 12)).astype("int32")
        x[f"{prefix}token_ids"] = ids
        x[f"{prefix}padding_mask"] = np.ones_like(ids)
    return x, np.roll(ids, -1, axis=1)


def shard_bytes(model) -> dict:
    """This process's bytes of the weights (its shards) and the full bytes."""
    from torch.distributed.tensor import DTensor

    mine = full = 0
    for v in model.weights:
        value = v.value
        local = value.to_local() if isinstance(value, DTensor) else value
        mine += local.numel() * local.element_size()
        full += value.numel() * value.element_size()
    return {"rank_bytes": mine, "full_bytes": full}


def train_evaluate_predict(
    build, x, batch_ranks: int, jit_compile: bool, y=None
) -> dict:
    """fit() two epochs, evaluate(), predict() on the first batch's rows;
    regression on 4 outputs, or next tokens where ``y`` holds their ids."""
    loss = "mse"
    if y is None:
        first = keras.tree.flatten(x)[0]
        y = np.random.default_rng(1).normal(size=(len(first), 4)).astype("float32")
    else:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = build()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=loss,
        metrics=[],  # keras-hub's classifiers add accuracy on labels,
        weighted_metrics=[],  # its language models weighted accuracy
        jit_compile=jit_compile,
    )

    def rows(a):
        return batch_rows(a, BATCH, batch_ranks)

    mine = keras.tree.map_structure(rows, x)
    per = BATCH // batch_ranks
    history = model.fit(
        mine, rows(y), batch_size=per, epochs=2, shuffle=False, verbose=0
    )
    loss = model.evaluate(mine, rows(y), batch_size=per, verbose=0)
    batch = keras.tree.map_structure(lambda a: rows(a)[:per], x)
    predictions = np.asarray(model.predict(batch, batch_size=per, verbose=0), "float64")
    if batch_ranks > 1:
        import torch.distributed as dist

        every = [None] * WORLD
        dist.all_gather_object(every, predictions)
        predictions = np.concatenate(every[:: WORLD // batch_ranks])
    return {
        "losses": history.history["loss"],
        "weights": weights(model),
        "metrics": {"evaluate": float(loss)},
        "predictions": predictions.tolist(),
        **shard_bytes(model),
    }


#: name -> (build, inputs, sample_input for the planner); inputs returns
#: features, or (features, next-token labels) for a language model.
MODELS = {
    "mlp": (lambda: mlp(), lambda: _features((16,)), None),
    "transformer": (transformer, lambda: _features((8, 16)), None),
    "bert": (bert, _tokens, None),
    "subclassed": (Subclassed, lambda: _features((16,)), np.zeros((2, 16), "float32")),
    "convnet": (convnet, lambda: _features((8, 8, 3)), None),
    "mixer": (mixer, lambda: _features((8, 16)), None),
}
#: keras-hub models of the slow tier (out of MODELS: test_auto_layout plans
#: each of MODELS on three meshes).
HUB = {
    "vit": (vit, lambda: _features((8, 8, 3)), None),
    "bart": (bart, lambda: _next_tokens(("encoder_", "decoder_")), None),
    "gemma": (gemma, _next_tokens, None),
}


def _planned_case(
    kind: str, mesh, jit_compile: bool, slow: bool, own_map: bool = False
) -> None:
    """Register ``kind`` on ``mesh``: on the planner's layout, or (``own_map``)
    on its backbone's ``get_layout_map``, the case named ``..._own_map``."""
    build, inputs, sample = {**MODELS, **HUB}[kind]

    def run():
        ranks = mesh[0] if WORLD > 1 else 1
        data = inputs()
        x, y = data if isinstance(data, tuple) else (data, None)
        return train_evaluate_predict(build, x, ranks, jit_compile, y)

    run.__name__ = (
        f"planned_{kind}{'_own_map' if own_map else ''}_{mesh[0]}x{mesh[1]}"
        + ("_compiled" if jit_compile else "")
    )
    layout = planned(build, sample)
    if own_map:
        from cases_hub import hub_layout

        layout = hub_layout(kind)
    options = {"per_rank": mesh[0] > 1, "slow": slow}
    case("planned", mesh=mesh, layout=layout, **options)(run)


# The default run: one eager and one compiled case per mesh.
_planned_case("mlp", (1, 2), jit_compile=False, slow=False)
_planned_case("transformer", (1, 2), jit_compile=False, slow=False)
_planned_case("mlp", (2, 1), jit_compile=True, slow=False)
_planned_case("transformer", (1, 2), jit_compile=True, slow=True)
_planned_case("bert", (1, 2), jit_compile=False, slow=False)
# The slow tier: the other meshes and modes, and the other models.
_planned_case("mlp", (1, 2), jit_compile=True, slow=True)
_planned_case("mlp", (2, 1), jit_compile=False, slow=True)
_planned_case("transformer", (2, 1), jit_compile=False, slow=True)
_planned_case("transformer", (2, 1), jit_compile=True, slow=True)
_planned_case("bert", (1, 2), jit_compile=True, slow=True)
_planned_case("bert", (2, 1), jit_compile=False, slow=True)
for _kind in ("subclassed", "convnet", "mixer"):
    _planned_case(_kind, (1, 2), jit_compile=False, slow=True)
    _planned_case(_kind, (1, 2), jit_compile=True, slow=True)
    _planned_case(_kind, (2, 1), jit_compile=False, slow=True)
# keras-hub's ViT classifier, BART (a seq2seq LM) and Gemma (a causal LM),
# Gemma on its own map too: the slow tier's.
for _kind, _mesh, _compiled in (
    ("vit", (1, 2), False),
    ("vit", (1, 2), True),
    ("vit", (2, 1), False),
    ("bart", (1, 2), False),
    ("bart", (1, 2), True),
    ("bart", (2, 1), False),
    ("gemma", (1, 2), False),
    ("gemma", (1, 2), True),
    ("gemma", (2, 1), False),
):
    _planned_case(_kind, _mesh, jit_compile=_compiled, slow=True)
    if _kind == "gemma":
        _planned_case(_kind, _mesh, jit_compile=_compiled, slow=True, own_map=True)
