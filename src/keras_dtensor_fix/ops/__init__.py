"""Op handling: the op-handler table and what its rows share.

``handlers`` (the table, its order, the wrappers the ``numpy`` and ``ops``
families install), ``call`` (:class:`~keras_dtensor_fix.ops.call.Call`, what
a row receives), ``layout`` (rows that place their own results:
convolutions, attention, ``slice_update``), ``values`` (the Keras-facing side
of the local/DTensor boundary the families share), ``first_call`` (a local
fast path's first call checked against the DTensor path), ``shardwise`` (an
optimizer's update on DTensor variables: aligned gradients, local-shard
math). Nothing else: compiled calls are ``compiled/``'s, generation
``generation/``'s.
"""
