"""Sharded keras-hub generation (the ``generate`` family): ``tokens`` (the
path a ``generate()`` takes, the token step compiled), ``local`` (eager, on
local tensors), ``decoder`` and ``causal_lm`` (a block's and a token's call
on local tensors), ``token_args`` (a ``call_with_cache``'s arguments).
"""
