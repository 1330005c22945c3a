"""keras-hub ``generate()`` compiled, a token at a time, for a sharded model.

keras-hub generates eagerly on torch, each op of each token a dispatched
DTensor op. Under ModelParallel, ``jit_compile=True`` runs each new token's
``call_with_cache`` as a ``compiled/region``: the cache keeps its shape and
the position is a tensor, so one graph serves every position and call. The
prompt's pass stays eager (:mod:`.local`). A token step that fails warns once
(its region's warning) and the class generates eagerly from then on.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils._pytree import tree_map

from keras_dtensor_fix.compiled import region
from keras_dtensor_fix.dtensor import DTensor, on_mesh, one_rank_replicated
from keras_dtensor_fix.engine.state import model_parallel
from keras_dtensor_fix.generation import causal_lm, decoder, local, token_args
from keras_dtensor_fix.ops.first_call import PROVEN, REFUSED

__all__ = ["forget", "generating"]


def _region(cls: type) -> region.Region:
    """The class's ``call_with_cache`` as a region (dynamic shapes, as
    torch.compile's default: a longer generate() call makes its cache length
    symbolic rather than compile again)."""
    return region.of_class(
        (cls, "call_with_cache"),
        lambda: region.Region(
            cls.call_with_cache,
            f"{cls.__name__}.call_with_cache",
            then="generate() of this class runs eagerly: its compiled token step "
            "is off from now on.",
            dynamic=None,
        ),
    )


def _compiled(steps: region.Region) -> Any:
    """The class's compiled token call, its guards checked again until this
    generation's tokens settle (a test makes it raise)."""
    steps.reset()
    return steps.compiled()


def _token_call(model: Any) -> Callable[..., Any]:
    """``model.call_with_cache``: one token compiled (on local tensors where
    :func:`.local.planned` plans the whole call, else on DTensors), the
    prompt's pass eager; logits and hidden states come back plain, as every
    process holds them."""
    plans, found = local.planned(model)
    eager = model.call_with_cache
    signature = token_args.signature_of(eager)
    steps = _region(type(model))
    compiled = _compiled(steps)
    plain = causal_lm.whole_inputs
    # the weights' mesh: the graph guards on its identity
    meshes = (getattr(v, "_value", None) for v in model.weights)
    mesh = next((m.device_mesh for m in meshes if isinstance(m, DTensor)), None)
    first = [True]

    def call_with_cache(*args: Any, **kwargs: Any) -> Any:
        given = token_args.one_token(signature, args, kwargs)
        if given is None:  # the prompt's pass
            with local.blocks_local(plans):
                return eager(*args, **kwargs)
        if steps.failed and local.WHOLE.known(model) is not PROVEN:
            # A proven model's cache is this rank's heads: only causal_lm.run
            # takes it (its compiled call falls back inside).
            return given.call(eager)
        if not first[0]:
            return step(given)
        first[0] = False
        try:
            return step(given)
        except Exception as err:  # noqa: BLE001 - upstream's eager call is the fallback
            local.WHOLE.remember(model, REFUSED)  # the cache stays a DTensor
            steps.fail(err)
            return given.call(eager)

    def step(given: token_args.TokenArgs) -> Any:
        # The first token can come as a DTensor (the prompt's), the next ones
        # plain: as the sampler's loop holds them, one graph for both.
        token_ids, index, extra = plain((given.token_ids, given.index, given.extra))
        given = token_args.TokenArgs(token_ids, given.cache, index, extra)
        if found is not None:
            result = local.whole_local(model, found, eager, compiled_or_eager, given)
            if result is not None:
                return result

        # The prompt's last token comes batch-sharded, the sampler's next ones
        # replicated: on a one-rank batch axis that is one graph, not two. A
        # cache can be a tree of tensors (Gemma3's pairs, Qwen3.5's three).
        def relabel(value: Any) -> Any:
            return one_rank_replicated(on_mesh(value, mesh))

        core, extra = tree_map(relabel, (given.core(), given.extra))
        logits, hidden, cache = compiled_or_eager(*core, **extra)
        return (*plain((logits, hidden)), cache)  # the cache as the graph takes it

    def compiled_or_eager(*args: Any, **kwargs: Any) -> Any:
        # any error, not only torch.compile's (the region's test): eager is
        # the fallback
        if not steps.failed:
            try:
                return compiled(model, *args, **kwargs)
            except Exception as err:  # noqa: BLE001
                steps.fail(err)
        return eager(*args, **kwargs)

    return call_with_cache


@contextlib.contextmanager
def _tokens_compiled(model: Any) -> Iterator[Any]:
    """Each new token compiled (the module); yields :func:`.causal_lm.whole_inputs`."""
    with decoder.attributes([(model, "call_with_cache", _token_call(model))]):
        yield causal_lm.whole_inputs


def generating(model: Any) -> Callable[[Any], Any] | None:
    """The context each ``generate()`` of ``model`` runs in, given the model
    (it yields what to do with ``generate_step``'s inputs, or None), or None
    where keras-hub's own generation stands: without ModelParallel, a
    one-device script generates exactly as without the plugin."""
    if model_parallel() is None:
        return None
    if (
        getattr(model, "jit_compile", False) is not True
        or not callable(getattr(type(model), "call_with_cache", None))
        or "call_with_cache" in vars(model)
        or (steps := _region(type(model))).failed
    ):
        return local.eager_local
    if token_args.signature_of(model.call_with_cache) is None:
        steps.failed = True  # nothing compiled: said as what happened
        warnings.warn(
            f"keras-dtensor-fix: {steps.what} does not take (token_ids, cache, "
            f"index); {steps.then}",
            stacklevel=2,
        )
        return local.eager_local  # as with jit_compile=False
    return _tokens_compiled


def forget() -> None:
    """Every compiled region (token calls and blocks: one registry) and learnt path
    (on deactivation; the compile family's revert drops the regions too)."""
    region.forget()
    local.BLOCKS.forget()
    local.WHOLE.forget()
