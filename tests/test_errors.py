"""Unfixable DTensor mixes raise an error that says what, where, and what to do.

The error is a ``DTensorMixError`` naming the op, every operand's shape (and a
DTensor's local shape and placements), the Keras layer the op ran in, and a
"What to do" line, with the error that made it chained as ``__cause__``.
Causes: a plain tensor shaped like one rank's shard (two ranks), shapes that
fit no placement (in-process and two ranks), an op without a DTensor rule
whose full-value fallback fails too, and a mix inside nested Keras layers.
"""

from __future__ import annotations

import json
import re

import pytest

from support import ROOT, run_ranks

SCRIPT = ROOT / "tests" / "ranks" / "errors.py"


def shard(dim: int) -> str:
    from torch.distributed.tensor import Shard

    return str(Shard(dim))  # "S(1)" in torch 2.13, "Shard(dim=1)" before


def assert_explains(message: str, op: str, *parts: str) -> None:
    assert message.startswith("keras-dtensor-fix: "), message
    assert f" {op} " in message.split("\n", 1)[0], message
    for part in parts:
        assert part in message, (part, message)
    assert "\nWhat to do: " in message, message
    assert message.rstrip().split("What to do: ", 1)[1].strip(), message


@pytest.fixture
def sharded(mesh1):
    """A (4, 8) DTensor, Shard(1) on the one-device mesh."""
    import torch
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(torch.arange(32.0).reshape(4, 8), mesh1, [Shard(1)])


@pytest.mark.parametrize(
    ("op", "plain_shape", "plain_first"),
    [("matmul", (3, 5), True), ("add", (3, 5), False), ("maximum", (2, 8), True)],
)
def test_shapes_that_fit_no_placement(sharded, op, plain_shape, plain_first) -> None:
    import keras
    import torch

    from keras_dtensor_fix.ops.values import DTensorMixError

    plain = torch.ones(plain_shape)
    args = (plain, sharded) if plain_first else (sharded, plain)
    with pytest.raises(DTensorMixError) as info:
        getattr(keras.ops, op)(*args)
    assert_explains(
        str(info.value),
        op,
        f"Tensor(shape={plain_shape}, dtype=torch.float32)",
        f"DTensor(shape=(4, 8), local=(4, 8), dtype=torch.float32, "
        f"placements=({shard(1)}))",
    )
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError), repr(cause)
    assert not isinstance(cause, DTensorMixError)
    sizes = re.findall(r"\d+", str(cause))
    assert str(plain_shape[-1]) in sizes or str(plain_shape[0]) in sizes, cause


def test_op_without_rule_whose_fallback_fails(mesh1) -> None:
    """bincount has no DTensor rule; the fallback on full values may fail too."""
    import keras
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from keras_dtensor_fix.ops.values import DTensorMixError

    dids = distribute_tensor(torch.tensor([0, 1, 1, 3, 2, 1]), mesh1, [Shard(0)])
    # It runs on full values (gathered, with a warning) when the inputs fit ...
    counts = keras.ops.bincount(dids, weights=torch.ones(6))
    assert isinstance(counts, DTensor)
    assert counts.full_tensor().tolist() == [1.0, 3.0, 1.0, 1.0]
    # ... and says what to do when they do not.
    with pytest.raises(DTensorMixError) as info:
        keras.ops.bincount(dids, weights=torch.ones(5))
    assert_explains(
        str(info.value),
        "bincount",
        f"DTensor(shape=(6,), local=(6,), dtype=torch.int64, placements=({shard(0)}))",
        "Tensor(shape=(5,), dtype=torch.float32)",
    )
    # PyTorch's DTensor error is chained; the full-value failure is quoted.
    cause = info.value.__cause__
    assert isinstance(cause, RuntimeError) and not isinstance(cause, DTensorMixError)
    assert "bincount" in str(cause), cause
    message = str(info.value)
    assert "full (gathered) values too" in message
    assert "weights" in message or "length" in message, message


def test_plain_only_errors_are_left_alone(mesh1) -> None:
    import keras
    import torch

    from keras_dtensor_fix.ops.values import DTensorMixError

    with pytest.raises(RuntimeError) as info:
        keras.ops.add(torch.ones(3, 5), torch.ones(4, 8))
    assert not isinstance(info.value, DTensorMixError)
    assert "keras-dtensor-fix" not in str(info.value)


LAYER_CODE = """
class Scale(keras.layers.Layer):
    def build(self, input_shape):
        self.w = self.add_weight(shape=(4, 8), name="w")

    def call(self, x):
        return keras.ops.multiply(x, self.w)


class Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = Scale(name="scale")

    def build(self, input_shape):
        pass

    def call(self, x):
        return self.scale(x)
"""


@pytest.mark.parametrize("filtering", [True, False])
def test_mix_inside_nested_keras_layers(mesh1, filtering) -> None:
    """A wrongly shaped input reaches a layer whose weight is sharded."""
    import keras
    import torch

    from keras_dtensor_fix.ops.values import DTensorMixError

    namespace = {"keras": keras}
    exec(LAYER_CODE, namespace)  # noqa: S102 - layer classes local to this test
    devices = keras.distribution.list_devices()
    device_mesh = keras.distribution.DeviceMesh((1,), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*scale/w"] = (None, "model")
    was_filtering = keras.config.is_traceback_filtering_enabled()
    (
        keras.config.enable_traceback_filtering
        if filtering
        else keras.config.disable_traceback_filtering
    )()
    try:
        with keras.distribution.ModelParallel(layout_map=layout_map).scope():
            block = namespace["Block"](name="block")
            with pytest.raises(DTensorMixError) as info:
                block(torch.ones(3, 5))
            weight = block.scale.w.value
    finally:
        (
            keras.config.enable_traceback_filtering
            if was_filtering
            else keras.config.disable_traceback_filtering
        )()
    assert type(weight).__name__ == "DTensor"
    message = str(info.value)
    ours = message[message.index("keras-dtensor-fix: ") :]
    assert_explains(
        ours,
        "multiply",
        "in Keras layer block/scale ",
        "Tensor(shape=(3, 5), dtype=torch.float32)",
        f"placements=({shard(1)})",
    )
    if filtering:
        # Keras re-raises a layer's error as a new one of the same type with
        # its call arguments added, "from None": the cause is lost, its text
        # stays in the message.
        assert message.startswith("Exception encountered when calling Scale.call()")
        assert info.value.__cause__ is None
        assert "(3, 5)" in message and "(4, 8)" in message
    else:
        cause = info.value.__cause__
        assert isinstance(cause, RuntimeError) and not isinstance(
            cause, DTensorMixError
        )


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("errors")
    proc = run_ranks(SCRIPT, str(out))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_two_ranks_agree(two_ranks) -> None:
    first, second = two_ranks
    assert first == second


def test_per_rank_shard_meets_sharded_dtensor(two_ranks) -> None:
    for rank in two_ranks:
        result = rank["per_rank_shard"]
        assert result["type"] == "DTensorMixError", result
        assert_explains(
            result["message"],
            "add",
            "Tensor(shape=(4, 4), dtype=torch.float32)",
            f"DTensor(shape=(4, 8), local=(4, 4), dtype=torch.float32, "
            f"placements=({rank['shard']}))",
            "per-rank shard",
        )
        hint = result["message"].split("What to do: ", 1)[1]
        assert "distribute" in hint and "distribute_tensor" in hint, hint
        assert result["cause_type"] == "PromotionError", result


def test_shapes_that_fit_no_placement_on_two_ranks(two_ranks) -> None:
    for rank in two_ranks:
        result = rank["matmul_shapes"]
        assert result["type"] == "DTensorMixError", result
        assert_explains(
            result["message"],
            "matmul",
            "Tensor(shape=(3, 5), dtype=torch.float32)",
            f"DTensor(shape=(4, 8), local=(4, 4), dtype=torch.float32, "
            f"placements=({rank['shard']}))",
        )
        assert result["cause_type"] == "RuntimeError", result


def test_per_rank_shard_inside_keras_layers(two_ranks) -> None:
    for rank in two_ranks:
        assert rank["kernel"] == {"type": "DTensor", "placements": [rank["shard"]]}
        filtered, unfiltered = rank["layer_filtered"], rank["layer_unfiltered"]
        assert filtered["type"] == unfiltered["type"] == "DTensorMixError"
        for result in (filtered, unfiltered):
            message = result["message"]
            ours = message[message.index("keras-dtensor-fix: ") :]
            assert_explains(
                ours,
                "add",
                "in Keras layer block/add_offset ",
                "Tensor(shape=(3, 4), dtype=torch.float32)",
                "DTensor(shape=(3, 8), local=(3, 4)",
                "per-rank shard",
            )
        assert unfiltered["cause_type"] == "PromotionError", unfiltered
        assert filtered["message"].startswith("Exception encountered when calling")


def test_layout_with_more_axes_than_the_variable(mesh1) -> None:
    """A LayoutMap entry with 3 axes for a 2-d kernel: an error naming the
    variable, its layout and one that works. Upstream (and the plugin before
    this check) raised torch's "IndexError: Dimension out of range" from
    inside DTensor."""
    import keras

    from keras_dtensor_fix.patches.variables import LayoutError

    devices = keras.distribution.list_devices()
    device_mesh = keras.distribution.DeviceMesh((1,), ["model"], devices)
    layout_map = keras.distribution.LayoutMap(device_mesh)
    layout_map[".*wide/kernel"] = (None, None, "model")
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        layer = keras.layers.Dense(4, name="wide")
        with pytest.raises(LayoutError) as info:
            layer.build((None, 3))
    error = info.value
    assert error.variable.endswith("wide/kernel")
    assert error.shape == (3, 4) and error.axes == (None, None, "model")
    assert "(None, 'model')" in error.hint
    assert "wide/kernel" in str(error) and "3 axes for its 2 dims" in str(error)
