"""The patcher and what it stands on: the one layer that applies and reverts patches.

``families`` (the table of patch families), ``targets`` (every Keras and torch
name the plugin knows), ``contract`` (what a family module exports),
``loader`` (a family's implementation, imported on first use), ``hooks``
(post-import hooks), ``wrappers`` (installing and removing a wrapper by
identity), ``patcher`` (applies and reverts; activate/deactivate), ``ledger``
(a row per target), ``install`` (whether this install can run
ModelParallel on torch, and the fix), ``state`` (what the families share at
run time) and ``config`` (the environment). Families import ``contract``,
``targets`` and ``state``, never ``patcher``.
"""
