"""Sharded keras-hub generation, used by the ``generate`` family.

``tokens`` (the token step compiled, ``jit_compile=True``, and which path a
``generate()`` takes), ``local`` (eager generation on local tensors, each
path checked once), ``decoder`` (a block's cached call on local tensors),
``causal_lm`` (the whole one-token call on local tensors), ``token_args``
(a ``call_with_cache``'s arguments). keras-hub's facts are in ``hub/``.
"""
