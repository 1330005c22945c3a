"""Patch family implementations: one module per row of :mod:`..families`.

Each exports ``IMPLEMENTATION`` (a
:class:`~keras_dtensor_fix.engine.contract.Implementation`).
The engine imports a module when the first Keras module its family patches is
imported; modules here never import one another. What families share lives
outside this package (:mod:`keras_dtensor_fix.ops.values`,
:mod:`keras_dtensor_fix.ops.handlers`, ...), and nothing outside it imports from
here except the engine's family loader.
"""
