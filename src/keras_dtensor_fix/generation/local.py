"""Sharded keras-hub generation on local tensors, each path checked once.

Eager generation runs each decoder block's cached call on local tensors where
:mod:`.decoder` plans it, and each token's whole call where :mod:`.causal_lm`
does; their first calls are checked against DTensor's (:data:`BLOCKS`,
:data:`WHOLE`). Nothing outlives one generation. Inside a local call the
gated wrappers are closed process-wide (``state.SHARDING`` emptied):
generating and training in two threads of one process is not supported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from keras_dtensor_fix.compiled.blocks import repeated
from keras_dtensor_fix.generation import causal_lm, decoder, token_args
from keras_dtensor_fix.ops.first_call import PROVEN, REFUSED, FirstCall, first_line

__all__ = ["BLOCKS", "WHOLE", "blocks_local", "eager_local", "planned", "whole_local"]


def _check(say: str, what: str) -> FirstCall:
    differ = f"its {what} on local tensors did not match"
    say += " (slower, same tokens): {cause}"
    return FirstCall(what, say, differ + " ({error})", differ + " (its results differ)")


#: Each decoder block's local call, and each model's local token call.
BLOCKS = _check("decoder block {owner} generates on DTensors", "call")
WHOLE = _check("{owner} generates block by block", "token call")


def _block_call(block: Any, found: decoder.Plan) -> Callable[..., Any]:
    """``block.call`` for one generation: local where :mod:`.decoder` can."""
    original = type(block).call.__get__(block, type(block))

    def call(*args: Any, **kwargs: Any) -> Any:
        return BLOCKS.run(
            block,
            lambda: decoder.run(found, original, args, kwargs),
            lambda: original(*args, **kwargs),
        )

    return call


def planned(model: Any) -> tuple[list[tuple[Any, Any]], causal_lm.ModelPlan | None]:
    """Each decoder block (``compiled.blocks.repeated``'s) with its
    :func:`.decoder.plan` (None: on DTensors), and :func:`.causal_lm.plan`
    where every block has one; a plan that raises warns. Once per
    ``generate()``: the blocks' calls and the whole call share them."""
    plans = []
    for block in repeated(model, 1):
        found = None
        if BLOCKS.known(block) is not REFUSED:
            try:
                found = decoder.plan(block)
            except Exception as err:  # noqa: BLE001 - the DTensor path is the fallback
                BLOCKS.refuse(block, f"decoder.plan raised ({first_line(err)})")
        plans.append((block, found))
    if WHOLE.known(model) is REFUSED or any(found is None for _, found in plans):
        return plans, None
    try:
        return plans, causal_lm.plan(model, plans)
    except Exception as err:  # noqa: BLE001 - block by block is the fallback
        WHOLE.refuse(model, f"causal_lm.plan raised ({first_line(err)})")
        return plans, None


def blocks_local(plans: list[tuple[Any, Any]]) -> contextlib.AbstractContextManager:
    """Each planned block's call local (over the call it had: a compiled
    region's, say) for the length of the context."""
    calls = [(b, "call", _block_call(b, p)) for b, p in plans if p is not None]
    return decoder.attributes(calls)


def whole_local(
    model: Any,
    found: causal_lm.ModelPlan,
    eager: Callable[..., Any],
    call: Callable[..., Any],
    given: token_args.TokenArgs,
) -> Any:
    """One token's ``call`` on local tensors (:func:`.causal_lm.run`), the
    first checked against ``eager``; None where the model generates block by
    block."""
    known = WHOLE.known(model)
    if known is PROVEN:
        return given.call(causal_lm.run, found, call)
    if known is REFUSED or any(BLOCKS.known(b) is REFUSED for b, _ in found.blocks):
        WHOLE.remember(model, REFUSED)  # the prompt's pass found a block differ
        return None

    def fast() -> Any:
        result = given.call(causal_lm.run, found, eager)
        if result is None:  # no local form: block by block
            WHOLE.remember(model, REFUSED)
        return result

    return WHOLE.run(
        model,
        fast,
        lambda: given.call(eager),
        compared=lambda result: causal_lm.as_dtensors(found, result),
    )


@contextlib.contextmanager
def eager_local(model: Any) -> Iterator[Any]:
    """Blocks on local tensors, and where :mod:`.causal_lm` can, each token's
    whole call; yields what to do with ``generate_step``'s inputs (or None)."""
    plans, found = planned(model)
    with blocks_local(plans):
        if found is None:
            yield None
            return
        eager = model.call_with_cache
        signature = token_args.signature_of(eager)  # causal_lm.plan found one

        def call_with_cache(*args: Any, **kwargs: Any) -> Any:
            # the prompt's pass (many tokens): block by block
            given = token_args.one_token(signature, args, kwargs)
            if given is None:
                return eager(*args, **kwargs)
            result = whole_local(model, found, eager, eager, given)
            return eager(*args, **kwargs) if result is None else result

        with decoder.attributes([(model, "call_with_cache", call_with_cache)]):
            yield causal_lm.whole_inputs
