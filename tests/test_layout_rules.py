"""A LayoutMap rule that matches no variable warns once, naming the rule and
the nearest variable paths (``checks/layout_rules.py``), when a model builds
its step under ModelParallel; a rule that matched, or no ModelParallel, says
nothing. Upstream (and the plugin before this check) said nothing: the
variables the rule was meant for train replicated."""

from __future__ import annotations

import warnings

import pytest


def fit(layout: dict | None, distribution: str = "model_parallel") -> list[str]:
    """Fit and evaluate a two-layer MLP under ``layout`` (twice: a second
    model on the same LayoutMap); the plugin's warnings, as text."""
    import keras
    import numpy as np

    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1,), ["model"], devices)
    if distribution == "data_parallel":
        dist = keras.distribution.DataParallel(device_mesh=mesh)
    else:
        layout_map = keras.distribution.LayoutMap(mesh)
        for rule, axes in (layout or {}).items():
            layout_map[rule] = axes
        dist = keras.distribution.ModelParallel(layout_map=layout_map)
    x = np.ones((8, 4), "float32")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            scope = dist.scope() if distribution else warnings.catch_warnings()
            with scope:
                model = keras.Sequential(
                    [
                        keras.layers.Input((4,)),
                        keras.layers.Dense(4, name="dense_1"),
                        keras.layers.Dense(2, name="dense_2"),
                    ]
                )
                model.compile("sgd", "mse")
                model.fit(x, x[:, :2], batch_size=4, verbose=0)
                model.evaluate(x, x[:, :2], batch_size=4, verbose=0)
    return [str(w.message) for w in caught if "LayoutMap rule" in str(w.message)]


GOOD = {".*dense_1/kernel": (None, "model"), ".*dense_2/kernel": ("model", None)}


def test_a_rule_that_matches_nothing_warns_once(mesh1) -> None:
    found = fit({**GOOD, ".*dnese_2/bias": ("model",)})
    assert len(found) == 1, found
    message = found[0]
    assert "'.*dnese_2/bias'" in message
    nearest = message.split("Nearest variable paths: ", 1)[1]
    assert (
        nearest.startswith("'sequential/dense_2/bias'")
        or "dense_2/bias" in (nearest.split(",")[0])
    ), message
    assert "What to do:" in message
    for rule in GOOD:  # rules that matched are not named
        assert repr(rule) not in message


def test_rules_that_match_say_nothing(mesh1) -> None:
    assert fit(GOOD) == []


@pytest.mark.parametrize("distribution", [None, "data_parallel"])
def test_no_model_parallel_says_nothing(mesh1, distribution) -> None:
    assert fit({".*nothing": (None, "model")}, distribution) == []


def test_nearest_paths() -> None:
    from keras_dtensor_fix.checks.layout_rules import nearest

    paths = ["model/dense_1/kernel", "model/dense_2/kernel", "model/norm/gamma"]
    assert sorted(nearest(".*dense_3/kernel", paths, 2)) == paths[:2]
    assert nearest(r"model/norm/gama", paths, 1) == ["model/norm/gamma"]


def test_keras_hub_rules_for_weights_a_model_lacks_say_nothing(mesh1) -> None:
    """Qwen3's rules (the layouts family's row) name biases it does not have
    and an untied output embedding: only a rule added to them warns."""
    pytest.importorskip("keras_hub")
    import keras
    import keras_hub

    from keras_dtensor_fix.checks.layout_rules import warn_unmatched

    backbone = keras_hub.models.Qwen3Backbone(
        vocabulary_size=64,
        num_layers=2,
        hidden_dim=32,
        num_query_heads=4,
        num_key_value_heads=2,
        intermediate_dim=64,
        head_dim=8,
    )
    devices = keras.distribution.list_devices()
    mesh = keras.distribution.DeviceMesh((1, 1), ["batch", "model"], devices)
    layout_map = type(backbone).get_layout_map(mesh)
    layout_map[".*token_embeding/embeddings"] = (None, "model")
    dist = keras.distribution.ModelParallel(layout_map=layout_map)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert warn_unmatched(backbone, dist) == [".*token_embeding/embeddings"]
    assert len(caught) == 1 and "token_embedding/embeddings" in str(caught[0].message)
