"""Sharded keras-hub generation's machinery, used by the ``generate`` family.

``tokens`` (the token step compiled, ``jit_compile=True``), ``local``
(eager generation on local tensors, each path checked once), ``token_args``
(a ``call_with_cache``'s arguments), ``decoder`` (a decoder block's cached
call on local tensors), ``causal_lm`` (the whole one-token call on local
tensors) and ``paths`` (which path each model and block generates on). What
they know of keras-hub's classes is in ``hub/``.
"""
