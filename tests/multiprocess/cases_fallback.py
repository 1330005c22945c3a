"""Scenario cases: generation's local fast paths defeated on purpose.

Eager sharded generation runs each decoder block on local tensors where
``decoder.plan`` proves Megatron's layout, and the whole one-token call where
``causal_lm.plan`` fits (``causal_lm.run``). Each case below makes one of
them fail where it cannot see it coming (its plan raises, or its first run
does): the family must warn once, naming the cause, and generate as
upstream's DTensor path does, one process's tokens (``test_hub.py``,
``test_generation_fast_paths_fall_back``). The compiled token step's own
fallbacks run on one process (``tests/test_generate.py``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
from cases_hub import hub_layout, short_prompts, tiny_causal_lm
from scenario_kit import case

#: case name -> the fragment each process's warning must hold
FALLBACKS: dict[str, str] = {}


def _broken(*args, **kwargs):
    raise RuntimeError("defeated on purpose")


def _uncompilable(cls: type) -> Callable:
    return _broken


def _generate_with(module: str, name: str) -> dict:
    """Gemma's greedy tokens (twice) with ``module.name`` raising."""
    from keras_dtensor_fix.generation import causal_lm, decoder
    from keras_dtensor_fix.patches import generate

    owner = {"causal_lm": causal_lm, "decoder": decoder, "generate": generate}[module]
    original: Callable = getattr(owner, name)
    setattr(owner, name, _uncompilable if module == "generate" else _broken)
    try:
        import keras

        keras.utils.set_random_seed(1)
        model = tiny_causal_lm("gemma")
        model.compile(sampler="greedy", jit_compile=module == "generate")
        prompt = short_prompts()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tokens = model.generate(prompt, max_length=12, stop_token_ids=None)
            again = model.generate(prompt, max_length=12, stop_token_ids=None)
    finally:
        setattr(owner, name, original)
    return {
        "tokens": np.asarray(tokens["token_ids"]).tolist(),
        "tokens_again": np.asarray(again["token_ids"]).tolist(),
        "plugin_warnings": [
            str(w.message) for w in caught if "keras-dtensor-fix" in str(w.message)
        ],
    }


def _fallback_case(module: str, name: str, expected: str) -> None:
    def run() -> dict:
        return _generate_with(module, name)

    run.__name__ = f"gemma_1x2_{module}_{name.lstrip('_')}_raises"
    FALLBACKS[run.__name__] = expected
    # upstream cannot generate on (1, 2) at all (test_upstream_hub)
    case("hub", layout=hub_layout("gemma"), upstream_slow=True)(run)


# decoder.plan raises: every block on DTensors (the whole call needs them all)
_fallback_case("decoder", "plan", "decoder.plan raised (RuntimeError")
# causal_lm.plan raises: the blocks local, the rest of the token on DTensors
_fallback_case("causal_lm", "plan", "causal_lm.plan raised (RuntimeError")
# causal_lm.run raises on the first token: its check keeps block by block
_fallback_case("causal_lm", "run", "did not match (RuntimeError")
# jit_compile=True, its compiled token call raising (nothing compiles): from
# the second token on, where the first token's whole call proved local and
# the cache is this rank's heads, the eager call runs inside causal_lm.run
_fallback_case("generate", "_compiled", "runs eagerly: its compiled token step")
# decoder.run raises on a block's first call: its check keeps it on DTensors
_fallback_case("decoder", "run", "did not match (RuntimeError")
