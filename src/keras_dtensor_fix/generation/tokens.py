"""keras-hub ``generate()`` compiled, a token at a time, for a sharded model.

keras-hub compiles generation on JAX and TensorFlow and runs it eagerly on
torch: every new token pays a whole eager forward pass, and on a sharded model
each of its ops is a dispatched DTensor op. Here, under ModelParallel, a
``CausalLM`` compiled with ``jit_compile=True`` runs each new token's cached
decoder call (``call_with_cache`` on one token) through a compiled region
(``compiled/region``: the process-keyed cache tag, guards skipped once this
generation's tokens settle): the cache keeps its shape and the position is a
tensor, so one graph serves every position and every later ``generate()``
call. The prompt's pass (the cache's first fill) stays eager and runs its
blocks on local tensors (:mod:`.local`); the sampler's loop gets plain
tensors, as eager generation does, so only the compiled token step touches
DTensors. A compiled call or first token that raises, or a
``call_with_cache`` whose token, cache and index it cannot read
(:mod:`.token_args`), warns once and that model generates eagerly from then
on. Nothing stays set on the model: its ``call_with_cache`` is replaced for
the length of one generation.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

from keras_dtensor_fix.compiled import region
from keras_dtensor_fix.dtensor import DTensor, on_mesh, one_rank_replicated
from keras_dtensor_fix.engine.state import model_parallel
from keras_dtensor_fix.generation import causal_lm, local, paths, token_args
from keras_dtensor_fix.generation.paths import CHECKED, DTENSOR

#: Distribution -> CausalLM class -> its ``call_with_cache`` as a region (one
#: per class: dynamo guards on the model it is called with).
_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def compiles(model: Any) -> bool:
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


def _compiled(cls: type) -> Any:
    """The class's compiled token call under this distribution, its guards
    checked again until this generation's tokens settle."""
    by_class = _COMPILED.setdefault(model_parallel(), {})
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
    ways as eagerly (:func:`.local.whole_local`) and the next ones compile the
    model's own call on local tensors (:func:`.causal_lm.run`: plain inputs,
    weights and cache, the plugin's collectives in the graph); else the
    graph takes the DTensors. Either way each token's logits and hidden
    states come back as the plain tensors every process holds whole (the
    sampler's loop runs on plain tensors: :func:`tokens_compiled`) and the
    cache as the next token's graph takes it. Arguments past the first three
    (image embeddings, masks) go on as given (:mod:`.token_args`). The first
    token's step falls back to the eager call where it raises.
    """
    from torch.utils._pytree import tree_map

    eager = model.call_with_cache
    signature = token_args.signature_of(eager)
    dist = model_parallel()
    compiled = _compiled(type(model))
    if dist is not None:
        plain, prompt = causal_lm.whole_inputs, local.blocks_local
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
            result = local.whole_local(model, found, eager, _compiled_or_eager, given)
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
def tokens_compiled(model: Any) -> Iterator[Any]:
    """Each new token compiled; sharded, the prompt's pass runs its blocks on
    local tensors (:func:`.local.blocks_local`), the tokens on local tensors where
    :func:`.causal_lm.plan` fits the whole model, and the sampler's loop gets
    plain tensors where every process holds them whole (as eagerly)."""
    sharded = model_parallel() is not None
    readable = token_args.signature_of(model.call_with_cache) is not None
    if not paths.eager(model) and not readable:
        _failed(model, "its call_with_cache does not take (token_ids, cache, index)")
    if paths.eager(model):  # as with jit_compile=False
        with (local.eager_local if sharded else _no_context)(model) as inputs:
            yield inputs
        return
    found = None
    if sharded and paths.whole(model) != DTENSOR:
        found = local.whole_plan(model)
    model.call_with_cache = _token_call(model, found)
    try:
        yield causal_lm.whole_inputs if sharded else None
    finally:
        vars(model).pop("call_with_cache", None)


def forget() -> None:
    """Every compiled token call and learnt path (on deactivation)."""
    _COMPILED.clear()
    paths.forget()
