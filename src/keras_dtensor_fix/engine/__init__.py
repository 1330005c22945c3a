"""The patcher and what it stands on: the one layer that applies and reverts patches.

``families`` (the family table), ``targets`` (every Keras and torch name the plugin
knows), ``contract`` (what a family module exports), ``loader`` (a family's
implementation, imported on first use), ``hooks`` (post-import hooks), ``wrappers``
(installed and removed by identity), ``patcher`` (activate/deactivate), ``ledger`` (a
row per target), ``install`` (whether this install can run ModelParallel on torch, and
the fix), ``state`` (what families share at run time), ``config`` (the environment).
Families import ``contract``, ``targets`` and ``state``, never ``patcher``."""
