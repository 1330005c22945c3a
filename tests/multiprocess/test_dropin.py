"""Drop-in for upstream Keras: scripts that run upstream also run with the plugin.

Each case of the ``dropin`` groups of ``scenarios.py`` trains on 2 ranks and
must equal one process of the same seed, as in ``test_parity``. What upstream
Keras (``KERAS_DTENSOR_FIX=0``, its promotion mode on) does with the same
script is run too and pinned in :data:`UPSTREAM`: the plugin must never fail
where upstream works, and goes further where upstream fails.

Controls: with the plugin off and Keras's promotion mode exited, every raw
torch operator case fails with DTensor's "mixed torch.Tensor and DTensor";
with the plugin on but DTensor's implicit replication turned off after
``set_distribution``, they fail the same way: the switch is what fixes them.
"""

from __future__ import annotations

import numpy as np
import pytest
from cases_dropin import BRANCHING, RAW_OPERATOR_CASES
from cases_fallback import LOCAL_FALLBACKS
from scenarios import CASES
from test_parity import assert_parity

from support import compiles_model_parallel, scenario_params

MIXED = "mixed torch.Tensor and DTensor"
# fp16 and bf16 compute rounds differently across shardings (see test_parity).
LOOSE = {
    "loss_scale_sgd_fp16": 1e-4,
    "loss_scale_sgd_bf16": 2e-3,
    "loss_scale_sgd_fp16_compiled": 2e-4,
}
#: The compiled cases whose optimizer branches on a tensor (Keras's ``cond``).
SELECTING = (*BRANCHING, "loss_scale_sgd_fp16_compiled")

#: What upstream Keras does with each case on 2 ranks: "ok" (equals one
#: process), "differs" (trains, to other losses than one process) or a
#: fragment of its error (a tuple: any one of them, by torch release).
#: Measured with keras-nightly 3.16.0.dev2026102704 and torch 2.13.0, 2.14.1
#: and 2.15.0 (``nox -s matrix``).
UPSTREAM = {
    "custom_loop_keras_loss": "ok",
    "loss_scale_sgd_fp16": "ok",
    "loss_scale_sgd_bf16": "ok",
    "lstm": "ok",
    "gru": "ok",
    # torch's DTensor convolution computes with the local kernel shard.
    "conv1d_output_channels": "must match the size of tensor b",
    # torch 2.14 rewrote DTensor's convolution rules: its strategy fails first.
    "conv1d_kernel_axis": (
        "could not create a primitive descriptor",  # torch 2.13
        "mixes None with placements across mesh dims",  # torch 2.14, 2.15
    ),
    "conv3d_input_channels": "to have 2 channels, but got 4",
    "depthwise_conv2d": "expected weight to be at least 4",
    "separable_conv2d": "expected weight to be at least 4",
    "conv2d_transpose": "must match the size of tensor b",
    "mha_causal_mask": "ok",
    # trains, but its batch order and dropout masks are not one process's
    "shuffled_dropout_fit": "differs",
    # cases_fallback.py: the plugin's local fast paths defeated on purpose;
    # upstream takes every op through DTensor and equals one process.
    "leaves_region_raises": "ok",
    "leaves_region_accepts_split": "ok",
    "dense_local_raises": "ok",
    "dense_activation_misread": "ok",
}


def cases(group: str) -> list[str]:
    return [name for name, spec in CASES.items() if spec["group"] == group]


def check(name: str, ranks: list[dict], single: dict) -> None:
    rtol = LOOSE.get(name)
    if rtol is None:
        assert_parity(name, ranks, single)
        return
    for rank in ranks:
        assert "error" not in rank[name], rank[name].get("traceback")
        np.testing.assert_allclose(
            rank[name]["losses"], single[name]["losses"], rtol=rtol
        )


@pytest.mark.parametrize("name", cases("dropin"))
def test_dropin_parity(runs, name: str) -> None:
    check(name, runs.get("dropin", world=2), runs.get("dropin", world=1)[0])


@pytest.mark.parametrize("name", sorted(LOCAL_FALLBACKS))
def test_local_fast_paths_fall_back(runs, name: str) -> None:
    """A local fast path of the training step defeated on purpose
    (``cases_fallback.py``: the ``leaves`` family's recognition raising or
    accepting a softmax over split features, the ``layers`` family's local
    dense call raising or taking a softmax activation for an elementwise
    one): each object's first call is checked against its own call on
    DTensors (``ops/first_call.py``), so every process warns once per
    layer, naming the cause, and trains as upstream does, one process's
    losses and weights (test_dropin_parity). Without the check the raising
    cases failed in fit() with the error, and the accepting ones trained to
    other losses than one process's, silently. Upstream equals one process
    (:data:`UPSTREAM`)."""
    every, some = LOCAL_FALLBACKS[name]
    for rank, result in enumerate(runs.get("dropin", world=2)):
        mine = result[name]
        assert "error" not in mine, (rank, mine.get("traceback"))
        warned = mine["plugin_warnings"]
        assert warned and all(every in w for w in warned), (rank, warned)
        assert any(some in w for w in warned), (rank, warned)
        assert len(warned) == len(set(warned)), warned  # once per layer


@pytest.mark.parametrize("name", scenario_params("dropin_compiled"))
def test_dropin_compiled(runs, name: str) -> None:
    ranks = runs.get("dropin_compiled", world=2)
    check(name, ranks, runs.get("dropin_compiled", world=1)[0])
    warned = ranks[0][name].get("plugin_warnings", [])
    if CASES[name].get("eager"):  # runs eagerly, and says so
        assert any(CASES[name]["eager"] in w for w in warned), warned
    elif compiles_model_parallel():
        assert ranks[0][name]["dynamo_graphs"] > 0, "it ran eagerly"
        allowed = CASES[name].get("warns", ())
        assert [w for w in warned if not any(a in w for a in allowed)] == []


#: Upstream on the compiled conv cases: it runs them eagerly and fails as on
#: their eager twins.
UPSTREAM_COMPILED = {
    "conv1d_output_channels_compiled": UPSTREAM["conv1d_output_channels"],
    "conv1d_kernel_axis_compiled": UPSTREAM["conv1d_kernel_axis"],
    "conv2d_input_channels_compiled": "to have 2 channels, but got 4",
    "conv3d_input_channels_compiled": UPSTREAM["conv3d_input_channels"],
    "depthwise_conv2d_compiled": UPSTREAM["depthwise_conv2d"],
    "separable_conv2d_compiled": UPSTREAM["separable_conv2d"],
    "conv2d_transpose_compiled": UPSTREAM["conv2d_transpose"],
}


def assert_fails_with(result: dict, expected: str | tuple) -> None:
    """``result`` is an error containing ``expected`` (or one of them)."""
    fragments = (expected,) if isinstance(expected, str) else expected
    error = result.get("error", "")
    assert any(fragment in error for fragment in fragments), result


def upstream_compiled(runs) -> dict:
    """Rank 0's results of upstream on the compiled conv and recurrent cases
    (one run for both tests)."""
    return runs.get("dropin_compiled", world=2, KERAS_DTENSOR_FIX="0")[0]


@pytest.mark.slow  # upstream (KERAS_DTENSOR_FIX=0): the slow tier's launch
def test_upstream_compiled_convs(runs) -> None:
    """Upstream fails every compiled conv case: the plugin compiles and trains them."""
    upstream = upstream_compiled(runs)
    for name in filter(runs.ran, UPSTREAM_COMPILED):
        assert_fails_with(upstream[name], UPSTREAM_COMPILED[name])


#: Upstream on the compiled recurrent cases (it runs them eagerly).
UPSTREAM_RECURRENT = {
    "lstm_compiled": "ok",
    "gru_compiled": "ok",
    # Keras's generic RNN loop unbinds the batch-sharded (1, 2) input.
    "masked_lstm_compiled": "unbind along the sharded dimension",
    "simple_rnn_compiled": "unbind along the sharded dimension",
}


@pytest.mark.slow  # upstream (KERAS_DTENSOR_FIX=0): the slow tier's launch
def test_upstream_compiled_recurrent(runs) -> None:
    """Upstream runs LSTM and GRU eagerly (0 dynamo graphs) and equals one
    process, and fails on the generic loop; the plugin compiles LSTM and GRU
    (without the ``rnn`` family the compiled LSTM's weights end 0.1 off one
    process's) and runs the generic loop eagerly."""
    upstream = upstream_compiled(runs)
    single = runs.get("dropin_compiled", world=1)[0]
    for name, expected in UPSTREAM_RECURRENT.items():
        if not runs.ran(name):
            continue
        if expected != "ok":
            assert_fails_with(upstream[name], expected)
            continue
        assert "error" not in upstream[name], upstream[name].get("traceback")
        assert upstream[name]["dynamo_graphs"] == 0
        np.testing.assert_allclose(
            upstream[name]["losses"], single[name]["losses"], rtol=1e-5
        )


#: The guide's GAN of Dense models (default tier) and its conv GAN (slow tier).
GANS = [
    "gan_compiled",
    pytest.param("conv_gan_compiled", marks=pytest.mark.slow),
]
#: Upstream on them: it runs them eagerly; the conv GAN's sharded kernels meet
#: torch's DTensor convolution, which computes with the local kernel shard
#: (as ``conv2d_transpose``).
UPSTREAM_GANS = {
    "gan_compiled": "ok",
    "conv_gan_compiled": UPSTREAM["conv2d_transpose"],
}


@pytest.mark.slow  # upstream (KERAS_DTENSOR_FIX=0): the slow tier's launch
@pytest.mark.parametrize("name", GANS)
def test_upstream_compiled_gan(runs, name: str) -> None:
    """Upstream runs the guide's Dense GAN eagerly (0 dynamo graphs) and
    equals one process, and fails its conv GAN; the plugin compiles both
    (test_dropin_compiled)."""
    if not runs.ran(name):
        pytest.skip(f"{name} not selected")
    upstream = upstream_compiled(runs)[name]
    if UPSTREAM_GANS[name] != "ok":
        assert_fails_with(upstream, UPSTREAM_GANS[name])
        return
    single = runs.get("dropin_compiled", world=1)[0][name]
    assert "error" not in upstream, upstream.get("traceback")
    assert upstream["dynamo_graphs"] == 0
    assert not upstream["compiled_to_the_end"]
    np.testing.assert_allclose(upstream["losses"], single["losses"], rtol=1e-5)


@pytest.mark.parametrize("name", GANS)
def test_compiled_gan_stays_compiled(runs, name: str) -> None:
    """The guide's GAN, compiled after another distribution's compiled fit in
    the same process, and its conv GAN (conv kernels split on "model"),
    compile their first batch and run the compiled step to the end on both
    ranks, with no fallback warning (parity: test_dropin_compiled), and
    dynamo compiles none of DTensor's subclass methods as a frame of its own
    (``compiled/frames.py``). Without ``dtensor.forget_meshes`` DTensor's
    sharding caches handed the Dense GAN the earlier, equal mesh object, a
    loss frame's backward failed to partition ("Node tangents_2 was invalid,
    but is output") and the step ran eagerly from the first batch, warned.
    Without ``frames.skip`` each ``backward()`` (a graph break, run with
    dynamo's frame hook on) had dynamo compile DTensor's
    ``__tensor_unflatten__`` once per gradient shape up to its recompile limit
    (8, warned) and ``__coerce_same_metadata_as_tangent__`` twice. Upstream
    runs the Dense GAN eagerly and fails the conv GAN (test above)."""
    if not runs.ran(name):
        pytest.skip(f"{name} not selected")
    if not compiles_model_parallel():
        pytest.skip("this Keras does not compile under ModelParallel")
    for rank, result in enumerate(runs.get("dropin_compiled", world=2)):
        gan = result[name]
        assert "error" not in gan, (rank, gan.get("traceback"))
        eager = [w for w in gan["plugin_warnings"] if "runs eagerly" in w]
        assert eager == [], (rank, eager)
        assert gan["compiled_to_the_end"], rank
        assert gan["helper_frames"] == 0, rank


@pytest.mark.parametrize(
    "name",
    scenario_params("dropin_compiled", tuple(n for n in CASES if n not in SELECTING)),
)
def test_optimizer_branches_compiled(runs, name: str) -> None:
    """Gradient accumulation (2 steps with clipnorm, 3 with global_clipnorm),
    EMA overwrites every 2 steps (both at once in the slow tier) and
    ``LossScaleOptimizer``'s finite-gradients branch compile
    into one graph with no break, on both ranks (parity and no warning:
    ``test_dropin_compiled``). Before the
    ``optimizers`` family selected ``cond``'s branches, Keras's ``if pred:``
    on the step count broke the graph, the first batch's compile failed
    ("expected example_value to be a FakeTensor, got DTensor") and the model
    ran eagerly, warned: 0 graphs, 1 break. Upstream: see the test below."""
    if not compiles_model_parallel():
        pytest.skip("this Keras does not compile under ModelParallel")
    for rank in runs.get("dropin_compiled", world=2):
        result = rank[name]
        assert "error" not in result, result.get("traceback")
        assert result["dynamo_graphs"] == 1, result["plugin_warnings"]
        assert result["graph_breaks"] == 0


@pytest.mark.slow  # upstream (KERAS_DTENSOR_FIX=0): the slow tier's launch
def test_upstream_compiled_optimizer_branches(runs) -> None:
    """Upstream runs accumulation and EMA overwrites eagerly under
    ModelParallel (0 dynamo graphs: it compiles nothing there) and equals one
    process; the plugin compiles them (test above)."""
    upstream = upstream_compiled(runs)
    single = runs.get("dropin_compiled", world=1)[0]
    for name in filter(runs.ran, SELECTING):
        assert "error" not in upstream[name], upstream[name].get("traceback")
        assert upstream[name]["dynamo_graphs"] == 0
        np.testing.assert_allclose(
            upstream[name]["losses"], single[name]["losses"], rtol=LOOSE.get(name, 1e-5)
        )


@pytest.mark.slow  # upstream (KERAS_DTENSOR_FIX=0): the slow tier's launch
@pytest.mark.parametrize("name", cases("dropin"))
def test_upstream_does_as_pinned(runs, name: str) -> None:
    """Upstream as users run it: what it does with the same script."""
    upstream = runs.get("dropin", world=2, KERAS_DTENSOR_FIX="0")[0][name]
    single = runs.get("dropin", world=1)[0][name]
    expected = UPSTREAM[name]
    if expected in ("ok", "differs"):
        assert "error" not in upstream, upstream.get("traceback")
        rtol = LOOSE.get(name, 1e-5)
        equal = np.allclose(upstream["losses"], single["losses"], rtol=rtol)
        assert equal == (expected == "ok"), (upstream["losses"], single["losses"])
    else:
        assert_fails_with(upstream, expected)


@pytest.mark.parametrize(
    "env",
    [
        {"KERAS_DTENSOR_FIX": "0", "SCENARIO_EXIT_PROMOTION": "1"},
        {"SCENARIO_NO_IMPLICIT_REPLICATION": "1"},
    ],
    ids=["upstream-without-mode", "plugin-without-switch"],
)
def test_raw_operator_controls(runs, env: dict) -> None:
    """Without promotion, every raw-operator case meets DTensor's mix error."""
    ranks = runs.get(
        "dropin", world=2, SCENARIO_CASES=",".join(RAW_OPERATOR_CASES), **env
    )
    for name in RAW_OPERATOR_CASES:
        assert MIXED in ranks[0][name].get("error", ""), (name, ranks[0][name])
