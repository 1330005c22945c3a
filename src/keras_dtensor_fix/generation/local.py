"""Sharded keras-hub generation on local tensors, each path checked once.

``jit_compile`` False or "auto" (Keras's default, eager on torch) generates
eagerly, and on a sharded model each decoder block's cached call runs on
local tensors where its layout allows (:mod:`.decoder`: Megatron's
per-token collectives, the cache split by heads), and each token's whole
call where :mod:`.causal_lm` plans it. The first call of each runs both
ways and compares, as every process finds it (:func:`.decoder.agree`): where
it fails or differs, one warning names the cause and that block or model
generates on DTensors from then on (:mod:`.paths`). Nothing stays set on the
model: its blocks' ``call`` and its ``call_with_cache`` are replaced for the
length of one generation. Inside a local call the gated wrappers are closed
process-wide (``state.SHARDING`` emptied): generating and training in two
threads of one process at once is not supported.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from keras_dtensor_fix.generation import causal_lm, decoder, paths, token_args
from keras_dtensor_fix.generation.paths import CHECKED, DTENSOR
from keras_dtensor_fix.hub import generation as hub


def _block_call(block: Any, found: decoder.Plan) -> Any:
    """``block.call`` for one generation: local where :mod:`.decoder` can."""
    original = type(block).call.__get__(block, type(block))

    def call(*args: Any, **kwargs: Any) -> Any:
        if paths.block(block) == DTENSOR:
            return original(*args, **kwargs)
        if paths.block(block) != CHECKED:
            return _checked(block, found, original, args, kwargs)
        result = decoder.run(found, original, args, kwargs)
        if result is NotImplemented:
            return original(*args, **kwargs)
        return result

    return call


def _compared(found: Any, expected: Any, attempt: Any, convert: Any = None) -> tuple:
    """``attempt()`` (a local call) against ``expected``, as every process
    finds (:func:`.decoder.agree`, which each calls even where its attempt
    raised): ``(result, "")`` where they agree, ``(NotImplemented, "")`` where
    the call has no local form, else ``(None, why)``."""
    try:
        result = attempt()
    except Exception as err:  # noqa: BLE001 - the slower path is the fallback
        result, why = None, f"{type(err).__name__}: {str(err)[:200]}"
    else:
        why = "its results differ"
    if result is NotImplemented:
        return NotImplemented, ""
    local = result if result is None or convert is None else convert(result)
    return (result, "") if decoder.agree(found, expected, local) else (None, why)


def _checked(block: Any, found: decoder.Plan, original: Any, args, kwargs) -> Any:
    """The block's first call, both ways: the local result where they agree
    (every process decides alike); else the DTensor path's, from then on."""
    expected = original(*args, **kwargs)
    result, why = _compared(
        found, expected, lambda: decoder.run(found, original, args, kwargs)
    )
    if result is NotImplemented:
        return expected
    if result is not None:
        paths.mark(block, block=CHECKED)
        return result
    paths.mark(block, block=DTENSOR)
    _slower(_block_name(block), "on DTensors", f"its call {_MISMATCH} ({why})")
    return expected


_MISMATCH = "on local tensors did not match"


def _block_name(block: Any) -> str:
    return f"decoder block {getattr(block, 'path', block.name)!r}"


def _slower(who: str, path: str, why: str) -> None:
    warnings.warn(
        f"keras-dtensor-fix: {who} generates {path} (slower, same tokens): {why}",
        stacklevel=4,
    )


def _block_plan(block: Any) -> decoder.Plan | None:
    """:func:`.decoder.plan`; one that raises warns, the block on DTensors."""
    try:
        return decoder.plan(block)
    except Exception as err:  # noqa: BLE001 - the DTensor path is the fallback
        paths.mark(block, block=DTENSOR)
        _slower(_block_name(block), "on DTensors", f"decoder.plan raised ({_why(err)})")
        return None


def whole_plan(model: Any) -> causal_lm.ModelPlan | None:
    """:func:`.causal_lm.plan`; one that raises warns, block by block."""
    try:
        return causal_lm.plan(model)
    except Exception as err:  # noqa: BLE001 - block by block is the fallback
        paths.mark(model, whole=DTENSOR)
        why = f"causal_lm.plan raised ({_why(err)})"
        _slower(type(model).__name__, "block by block", why)
        return None


def _why(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:200]}"


@contextlib.contextmanager
def blocks_local(model: Any) -> Iterator[None]:
    blocks = hub.decoder_blocks(model)
    installed = []  # each with the call it had (a compiled region's, say)
    try:
        for block in blocks or ():
            found = None if paths.block(block) == DTENSOR else _block_plan(block)
            if found is not None:
                installed.append((block, vars(block).get("call")))
                object.__setattr__(block, "call", _block_call(block, found))
        yield
    finally:
        for block, call in installed:
            if call is None:
                vars(block).pop("call", None)
            else:
                object.__setattr__(block, "call", call)


def _local_token_call(model: Any, found: causal_lm.ModelPlan) -> Any:
    """``model.call_with_cache``: one token on local tensors, the prompt's
    pass block by block; the first token both ways (:func:`_model_checked`)."""
    eager = model.call_with_cache
    signature = token_args.signature_of(eager)  # causal_lm.plan found one

    def call_with_cache(*args: Any, **kwargs: Any) -> Any:
        given = None if signature is None else token_args.split(signature, args, kwargs)
        shape = getattr(getattr(given, "token_ids", None), "shape", ())
        if given is None or len(shape) != 2 or shape[1] != 1:
            return eager(*args, **kwargs)
        result = whole_local(model, found, eager, eager, given)
        return given.call(eager) if result is NotImplemented else result

    return call_with_cache


def whole_local(
    model: Any,
    found: causal_lm.ModelPlan,
    eager: Any,
    call: Any,
    given: token_args.TokenArgs,
) -> Any:
    """One token's ``call`` on local tensors (:func:`.causal_lm.run`), the
    first both ways (:func:`_model_checked`); :data:`NotImplemented` where
    the model generates block by block or the token has no local form."""
    if paths.whole(model) == DTENSOR:
        return NotImplemented
    if paths.whole(model) != CHECKED:
        return _model_checked(model, found, eager, given)
    return given.call(causal_lm.run, found, call)


def _model_checked(
    model: Any, found: causal_lm.ModelPlan, eager: Any, given: token_args.TokenArgs
) -> Any:
    """The first token's call, both ways: the local result where they agree
    (every process decides alike); else block by block from then on."""
    expected = given.call(eager)
    if any(paths.block(block) == DTENSOR for block, _ in found.blocks):
        paths.mark(model, whole=DTENSOR)  # the prompt's pass found a block differ
        return expected
    result, why = _compared(
        found,
        expected,
        lambda: given.call(causal_lm.run, found, eager),
        lambda local: causal_lm.as_dtensors(found, local),
    )
    if result is not None and result is not NotImplemented:
        paths.mark(model, whole=CHECKED)
        return result
    paths.mark(model, whole=DTENSOR)
    if result is None:  # it raised or differed (NotImplemented: no local form)
        what = f"its token call {_MISMATCH} ({why})"
        _slower(type(model).__name__, "block by block", what)
    return expected


@contextlib.contextmanager
def eager_local(model: Any) -> Iterator[Any]:
    """Blocks on local tensors, and where :mod:`.causal_lm` can, each token's
    whole call; yields what to do with ``generate_step``'s inputs (or None)."""
    with blocks_local(model):
        blocks = hub.decoder_blocks(model)
        found = None
        differ = any(paths.block(b) == DTENSOR for b in blocks)
        if paths.whole(model) != DTENSOR and not differ:
            found = whole_plan(model)
        if found is None:
            yield None
            return
        model.call_with_cache = _local_token_call(model, found)
        try:
            yield causal_lm.whole_inputs
        finally:
            vars(model).pop("call_with_cache", None)
