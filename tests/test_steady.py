"""``compiled.region.Steady``: a compiled function's guards skipped once it settles.

The generate family wraps each generation's compiled token call in it. A
global the function reads is one of dynamo's guards: changed after the calls
settled, a skipped guard keeps the old graph (which shows the guards are not
evaluated); in every other case the guards run and the function compiles
again. dynamo's ``eager`` backend: guards and cache entries, no code generation.
"""

from __future__ import annotations

import pytest
import torch

from keras_dtensor_fix.compiled import region
from keras_dtensor_fix.compiled.region import Steady, code_of

SCALE = 1.0
#: One entry per call that ran with its guards skipped.
UNGUARDED: list[bool] = []


def scaled(x: torch.Tensor) -> torch.Tensor:
    return x * SCALE


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    global SCALE
    SCALE = 1.0
    original = region._unguarded

    def counted():
        stance = original()
        if stance is not None:
            UNGUARDED.append(True)
        return stance

    monkeypatch.setattr(region, "_unguarded", counted)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def unguarded(call: Steady, x: torch.Tensor) -> bool:
    """Whether ``call(x)`` runs under torch's stance that skips guard evaluation."""
    before = len(UNGUARDED)
    call(x)
    return len(UNGUARDED) > before


def steady() -> Steady:
    return Steady(torch.compile(scaled, backend="eager"), code_of(scaled))


def test_settled_calls_skip_their_guards() -> None:
    global SCALE
    call, x = steady(), torch.ones(3)
    call(x)
    assert not unguarded(call, x)  # one call before: nothing to compare with
    assert unguarded(call, x)
    SCALE = 2.0
    assert call(x).tolist() == [1.0] * 3  # the guard on SCALE was skipped
    # the next generation's wrapper evaluates its guards again
    assert steady()(x).tolist() == [2.0] * 3


def test_another_signature_runs_with_guards() -> None:
    global SCALE
    call = steady()
    call(torch.ones(3))
    call(torch.ones(3))
    SCALE = 2.0
    assert call(torch.ones(4)).tolist() == [2.0] * 4
    assert call(torch.ones(3, requires_grad=True)).tolist() == [2.0] * 3
    assert not unguarded(call, torch.ones(3, requires_grad=True))


def test_a_call_that_compiles_again_does_not_settle() -> None:
    global SCALE
    call, x = steady(), torch.ones(3)
    call(x)
    SCALE = 2.0
    assert call(x).tolist() == [2.0] * 3  # compiled again: not settled
    SCALE = 3.0
    assert not unguarded(call, x)
    assert call(x).tolist() == [3.0] * 3


def test_a_users_stance_is_kept() -> None:
    global SCALE
    call, x = steady(), torch.ones(3)
    call(x)
    call(x)
    SCALE = 2.0
    with torch.compiler.set_stance("force_eager"):
        assert call(x).tolist() == [2.0] * 3  # eager, as the user asked


def test_nothing_settles_at_the_recompile_limit() -> None:
    with torch._dynamo.config.patch(recompile_limit=1):
        call, x = steady(), torch.ones(3)
        call(x)
        call(x)
        assert not unguarded(call, x)  # a later miss would run eagerly, unseen


def interleaved() -> Steady:
    compiled = torch.compile(scaled, backend="eager")
    return Steady(compiled, code_of(scaled), interleaved=True)


def test_calls_taking_turns_settle_each_signature() -> None:
    # Repeated blocks call one compiled function in turn, each block an
    # argument of its own: no two calls in a row share a signature.
    global SCALE
    call, turns = interleaved(), (torch.ones(3), torch.ones(4))
    for x in turns:
        call(x)
    for x in turns:
        assert not unguarded(call, x)  # one call each before: each settles now
    assert [unguarded(call, x) for x in turns] == [True, True]
    SCALE = 2.0
    assert [call(x).tolist() for x in turns] == [[1.0] * 3, [1.0] * 4]
    call.reset()  # a new step: the guards run again
    assert call(torch.ones(3)).tolist() == [2.0] * 3
    assert not unguarded(call, torch.ones(3))


def test_taking_turns_does_not_settle_a_plain_steady() -> None:
    call = steady()
    for x in (torch.ones(3), torch.ones(4)) * 3:
        assert not unguarded(call, x)


def test_a_turn_that_compiles_again_does_not_settle() -> None:
    global SCALE
    call, x = interleaved(), torch.ones(3)
    call(x)
    call(torch.ones(4))
    SCALE = 2.0
    assert call(x).tolist() == [2.0] * 3  # compiled again: not settled
    assert not unguarded(call, x)


def test_a_settled_call_runs_without_the_compile_wrappers() -> None:
    """Blocks mode wraps each region in settings that matter only when dynamo
    compiles (``region.compile_static``): a settled call, which cannot compile,
    runs the compiled function without them; guarded calls keep them."""
    plain = torch.compile(scaled, backend="eager")
    wrapped_calls = []

    def wrapped(x):
        wrapped_calls.append(1)
        return plain(x)

    call, x = Steady(wrapped, code_of(scaled), settled_call=plain), torch.ones(3)
    call(x)
    call(x)
    assert len(wrapped_calls) == 2
    assert unguarded(call, x)
    assert len(wrapped_calls) == 2  # settled: the plain compiled function
