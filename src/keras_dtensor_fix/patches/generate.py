"""keras-hub generate() compiled on torch for a sharded model with jit_compile=True.

keras-hub compiles generation on JAX and TensorFlow and runs it eagerly on
torch: every new token pays a whole eager forward pass, and on a sharded model
each of its ops is a dispatched DTensor op. Here, under ModelParallel, a
``CausalLM`` compiled with ``jit_compile=True`` runs each new token's cached
decoder call (``call_with_cache`` on one token) through ``torch.compile``: the
cache keeps its shape and the position is a tensor, so one graph serves every
position and every later ``generate()`` call. The prompt's pass (the cache's
first fill) stays eager: it runs once per call, with the prompt's shape.
Sharded, the graph holds this process's shards and collectives; its compile-
cache key names the process, as the training steps' do
(``compiled/cache_key``); the prompt's pass runs its blocks on local tensors
and the sampler's loop gets plain tensors, as eager generation does (below),
so only the compiled token step touches DTensors. Within one generation,
tokens skip dynamo's guard checks once one compiled nothing right after a
token of the same kind (``compiled/steady.py``).

``jit_compile`` False or "auto" (Keras's default, eager on torch) generates
eagerly, and on a sharded model each decoder block's cached call runs on
local tensors where its layout allows (``generation/decoder.py``: Megatron's
per-token collectives, the cache split by heads), checked once per block
against the DTensor path. Each fast path steps aside, with one warning
naming the cause, where it fails: a compiled call or first token that
raises, or a ``call_with_cache`` whose token, cache and index it cannot
read (``generation/token_args.py``), and that model generates eagerly from then
on; a block's or the whole call's local plan that raises, and that block
or model generates on DTensors. Nothing stays set on the model: its
``call_with_cache`` (compiled) or its blocks' ``call`` (eager, sharded) are
replaced for the length of one generation. Inside a local call the gated
wrappers are closed process-wide (``state.SHARDING`` emptied): sharded ops in
another thread meanwhile would find them closed, so generating and training
in two threads of one process at once is not supported.
"""

from __future__ import annotations

import contextlib
import types
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from keras_dtensor_fix.compiled import region
from keras_dtensor_fix.dtensor import DTensor, on_mesh, one_rank_replicated
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import model_parallel
from keras_dtensor_fix.generation import causal_lm, decoder, paths, token_args
from keras_dtensor_fix.generation.paths import CHECKED, DTENSOR
from keras_dtensor_fix.hub import generation as hub

#: Distribution -> CausalLM class -> its ``call_with_cache`` as a region (one
#: per class: dynamo guards on the model it is called with).
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _compiles(model: Any) -> bool:
    # Only sharded: without ModelParallel keras-hub's eager generation stands,
    # so a one-device script compiles exactly what it does without the plugin.
    call = getattr(type(model), "call_with_cache", None)
    return (
        model_parallel() is not None
        and getattr(model, "jit_compile", False) is True
        and callable(call)
        and "call_with_cache" not in vars(model)
        and not paths.eager(model)
    )


def _compiled(cls: type, dist: Any) -> Any:
    """The class's compiled token call under ``dist``, its guards checked
    again until this generation's tokens settle."""
    by_class = _COMPILED.setdefault(dist, {})
    found = by_class.get(cls)
    if found is None:
        # dynamic shapes as torch.compile's default: a longer generate() call
        # makes its cache length symbolic rather than compile again
        what = f"{cls.__name__}.call_with_cache"
        found = by_class[cls] = region.Region(cls.call_with_cache, what, dynamic=None)
    found.reset()
    return found.compiled()


def _token_call(model: Any, found: causal_lm.ModelPlan | None = None) -> Any:
    """``model.call_with_cache``: one token compiled, the prompt's pass eager.

    The compiled call and its cache tag are made once per generation, not per
    token: the distribution does not change inside one ``generate()``.
    Sharded, the prompt's pass runs its blocks on local tensors; with
    ``found`` (the whole token call's local plan) the first token runs both
    ways as eagerly (:func:`_model_checked`) and the next ones compile the
    model's own call on local tensors (:func:`.causal_lm.run`: plain inputs,
    weights and cache, the plugin's collectives in the graph); else the
    graph takes the DTensors. Either way each token's logits and hidden
    states come back as the plain tensors every process holds whole (the
    sampler's loop runs on plain tensors: :func:`_tokens_compiled`) and the
    cache as the next token's graph takes it. Arguments past the first three
    (image embeddings, masks) go on as given (:mod:`.token_args`). The first
    token's step falls back to the eager call where it raises.
    """
    from torch.utils._pytree import tree_map

    eager = model.call_with_cache
    signature = token_args.signature_of(eager)
    dist = model_parallel()
    compiled = _compiled(type(model), dist)
    if dist is not None:
        plain, prompt = causal_lm.whole_inputs, _blocks_local
        # the weights' mesh: the graph guards on its identity
        meshes = (getattr(v, "_value", None) for v in model.weights)
        mesh = next((m.device_mesh for m in meshes if isinstance(m, DTensor)), None)
    else:
        plain, prompt, mesh = tuple, _no_context, None
    first = [True]

    def call_with_cache(*args: Any, **kwargs: Any) -> Any:
        given = None if signature is None else token_args.split(signature, args, kwargs)
        shape = getattr(getattr(given, "token_ids", None), "shape", ())
        if given is None or len(shape) != 2 or shape[1] != 1:  # the prompt's pass
            with prompt(model):
                return eager(*args, **kwargs)
        if paths.eager(model) and paths.whole(model) != CHECKED:
            # A checked model's cache is this rank's heads: only
            # causal_lm.run takes it (its compiled call falls back inside).
            return given.call(eager)
        if not first[0]:
            return _step(given)
        first[0] = False
        try:
            return _step(given)
        except Exception as err:  # noqa: BLE001 - upstream's eager call is the fallback
            # the cache stays a DTensor from here
            paths.mark(model, whole=DTENSOR)
            _failed(model, f"{type(err).__name__}: {str(err)[:300]}")
            return given.call(eager)

    def _step(given: token_args.TokenArgs) -> Any:
        # The first token can come as a DTensor (the prompt's), the next
        # ones plain: as the sampler's loop holds them, one graph for both.
        token_ids, index = plain((given.token_ids, given.index))
        extra = dict(zip(given.extra, plain(tuple(given.extra.values())), strict=True))
        given = token_args.TokenArgs(token_ids, given.cache, index, extra)
        if found is not None:
            result = _whole_local(model, found, eager, _compiled_or_eager, given)
            if result is not NotImplemented:
                return result
        logits, hidden, cache = _token(given)
        return (*plain((logits, hidden)), cache)  # the cache as the graph takes it

    def _compiled_or_eager(*args: Any, **kwargs: Any) -> Any:
        if paths.eager(model):
            return eager(*args, **kwargs)
        try:
            return compiled(model, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 - eager is the fallback
            _failed(model, f"{type(err).__name__}: {str(err)[:300]}")
            return eager(*args, **kwargs)

    def _token(given: token_args.TokenArgs) -> Any:
        # The prompt's last token comes batch-sharded, the sampler's next
        # ones replicated: on a one-rank batch axis that is one graph, not two.
        # A cache can be a tree of tensors (Gemma3's pairs, Qwen3.5's three).
        def relabel(value: Any) -> Any:
            return one_rank_replicated(on_mesh(value, mesh))

        core, extra = tree_map(relabel, (given.core(), given.extra))
        return _compiled_or_eager(*core, **extra)

    return call_with_cache


def _failed(model: Any, why: str) -> None:
    paths.mark(model, eager=True)
    warnings.warn(
        f"keras-dtensor-fix: generate() of this jit_compile=True model runs "
        f"eagerly: its compiled token step failed ({why})",
        stacklevel=5,
    )


@contextlib.contextmanager
def _no_context(model: Any) -> Iterator[None]:
    yield None


@contextlib.contextmanager
def _tokens_compiled(model: Any) -> Iterator[Any]:
    """Each new token compiled; sharded, the prompt's pass runs its blocks on
    local tensors (:func:`_blocks_local`), the tokens on local tensors where
    :func:`.causal_lm.plan` fits the whole model, and the sampler's loop gets
    plain tensors where every process holds them whole (as eagerly)."""
    sharded = model_parallel() is not None
    readable = token_args.signature_of(model.call_with_cache) is not None
    if not paths.eager(model) and not readable:
        _failed(model, "its call_with_cache does not take (token_ids, cache, index)")
    if paths.eager(model):  # as with jit_compile=False
        with (_eager_local if sharded else _no_context)(model) as inputs:
            yield inputs
        return
    found = None
    if sharded and paths.whole(model) != DTENSOR:
        found = _whole_plan(model)
    model.call_with_cache = _token_call(model, found)
    try:
        yield causal_lm.whole_inputs if sharded else None
    finally:
        vars(model).pop("call_with_cache", None)


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


def _whole_plan(model: Any) -> causal_lm.ModelPlan | None:
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
def _blocks_local(model: Any) -> Iterator[None]:
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
        result = _whole_local(model, found, eager, eager, given)
        return given.call(eager) if result is NotImplemented else result

    return call_with_cache


def _whole_local(
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
def _eager_local(model: Any) -> Iterator[Any]:
    """Blocks on local tensors, and where :mod:`.causal_lm` can, each token's
    whole call; yields what to do with ``generate_step``'s inputs (or None)."""
    with _blocks_local(model):
        blocks = hub.decoder_blocks(model)
        found = None
        differ = any(paths.block(b) == DTENSOR for b in blocks)
        if paths.whole(model) != DTENSOR and not differ:
            found = _whole_plan(model)
        if found is None:
            yield None
            return
        model.call_with_cache = _local_token_call(model, found)
        try:
            yield causal_lm.whole_inputs
        finally:
            vars(model).pop("call_with_cache", None)


def _make_generate_function(wrapped, instance, args, kwargs):
    function = wrapped(*args, **kwargs)
    if _compiles(instance):
        context = _tokens_compiled
    elif model_parallel() is not None:
        context = _eager_local
    else:
        return function

    def generate_function(*call_args: Any, **call_kwargs: Any) -> Any:
        with context(instance) as inputs:
            if inputs is not None:
                call_args = inputs(call_args)
            return function(*call_args, **call_kwargs)

    return generate_function


def patches(module: types.ModuleType) -> list[Patch]:
    cls = getattr(module, "CausalLM", None)
    if not callable(getattr(cls, "make_generate_function", None)):
        raise LookupError("CausalLM.make_generate_function")
    return [
        Patch(
            module.__name__, "CausalLM.make_generate_function", _make_generate_function
        )
    ]


def _forget() -> None:
    _COMPILED.clear()
    paths.forget()


IMPLEMENTATION = Implementation(patches, after_revert=_forget)
