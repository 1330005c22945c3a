"""``ops/first_call.FirstCall``, the first-call check of the local fast paths,
on one process with plain tensors (no gathers, no all-reduce).

The ``leaves`` and ``layers`` families run each layer's first local call and
its own call (DTensor's path) and keep the fast path only where both agree;
the scenario cases (``multiprocess/cases_fallback.py``) defeat them on 2
ranks. Here: what a first call returns, what it warns, what it writes (once,
not twice), what it remembers and for how long.
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from keras_dtensor_fix.ops.first_call import (
    PROVEN,
    REFUSED,
    UNKNOWN,
    FirstCall,
    first_line,
)


class Layer:
    """What the check reads of a layer: a name and its ``add_loss`` list."""

    def __init__(self) -> None:
        self.name = "norm"
        self._losses: list = []


class Variable:
    """A variable as the check reads it: its value tensor, written in place."""

    def __init__(self) -> None:
        self._value = torch.zeros(2)


def own_call(layer: Layer, variable: Variable):
    """The layer's own call: writes its variable, adds a loss."""

    def own():
        with torch.no_grad():
            variable._value.add_(1.0)
        layer._losses.append(torch.ones(()))
        return torch.full((3,), 2.0)

    return own


def test_a_matching_fast_path_is_kept_and_writes_once() -> None:
    layer, variable, check = Layer(), Variable(), FirstCall("a fast path")

    def fast():
        with torch.no_grad():
            variable._value.add_(1.0)
        layer._losses.append(torch.ones(()))
        return torch.full((3,), 2.0) + 0.0

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = check.run(layer, fast, own_call(layer, variable), [variable])
    assert torch.equal(result, torch.full((3,), 2.0))
    assert check.known(layer) is PROVEN
    assert torch.equal(variable._value, torch.ones(2))  # written once
    assert len(layer._losses) == 1  # the check's own call adds none


@pytest.mark.parametrize(
    ("fast", "cause"),
    [
        (
            lambda: (_ for _ in ()).throw(RuntimeError("boom")),
            "raised (RuntimeError: boom)",
        ),
        (lambda: torch.full((3,), 2.5), "did not match DTensor's path"),
        (lambda: torch.full((4,), 2.0), "did not match DTensor's path"),
    ],
    ids=["raises", "differs", "shaped-otherwise"],
)
def test_a_failing_fast_path_warns_once_and_returns_the_own_call(fast, cause) -> None:
    layer, variable, check = Layer(), Variable(), FirstCall("a fast path")
    with pytest.warns(UserWarning) as caught:
        result = check.run(layer, fast, own_call(layer, variable), [variable])
    messages = [str(w.message) for w in caught]
    assert messages == [
        f"keras-dtensor-fix: a fast path on norm {cause}; it runs on DTensors "
        "from now on, as upstream Keras runs it."
    ]
    assert torch.equal(result, torch.full((3,), 2.0))
    assert check.known(layer) is REFUSED
    # the own call's writes and loss once: the check's are undone
    assert torch.equal(variable._value, torch.ones(2))
    assert len(layer._losses) == 1


def test_a_declining_fast_path_learns_nothing() -> None:
    layer, variable, check = Layer(), Variable(), FirstCall("a fast path")
    result = check.run(layer, lambda: None, own_call(layer, variable), [variable])
    assert torch.equal(result, torch.full((3,), 2.0))
    assert check.known(layer) is UNKNOWN


def test_an_own_call_that_fails_too_raises_the_fast_paths_error() -> None:
    layer, check = Layer(), FirstCall("a fast path")

    def fast():
        raise ValueError("fast")

    def own():
        raise ValueError("own")

    with pytest.raises(ValueError, match="fast"):
        check.run(layer, fast, own)


def test_outcomes_are_held_weakly_and_forgotten() -> None:
    layer, check = Layer(), FirstCall("a fast path")
    check.run(layer, lambda: torch.ones(1), lambda: torch.ones(1))
    assert check.known(layer) is PROVEN
    check.forget()
    assert check.known(layer) is UNKNOWN
    check.run(layer, lambda: torch.ones(1), lambda: torch.ones(1))
    del layer
    gc.collect()
    assert len(check._known) == 0


def test_a_compared_view_is_checked_and_the_result_returned() -> None:
    """``compared`` is what of the fast result stands for the own call's (a
    token's cache as the DTensor it is a part of); the result stays as is."""
    layer, check = Layer(), FirstCall("a fast path", say="{owner} slower: {cause}")

    def compared(result):
        return torch.cat([result, torch.ones(1)])

    result = check.run(
        layer, lambda: torch.ones(2), lambda: torch.ones(3), (), compared
    )
    assert torch.equal(result, torch.ones(2)) and check.known(layer) is PROVEN
    with pytest.warns(UserWarning, match="norm slower: did not match"):
        check.run(Layer(), lambda: torch.ones(2), lambda: torch.ones(3))


@pytest.mark.parametrize(
    ("error", "said"),
    [
        (RuntimeError("expected one of:\nmore"), "RuntimeError: expected one of:"),
        (RuntimeError(), "RuntimeError"),
    ],
)
def test_a_warning_names_the_errors_first_line_as_written(error, said) -> None:
    """The type and first line of the error, its own last colon kept (a message
    ending in one lost it when an empty message's ": " was stripped)."""
    assert first_line(error) == said
