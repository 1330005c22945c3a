"""Patch family implementations: one module per row of :mod:`..families`.

Each exports ``IMPLEMENTATION`` (an :class:`~keras_dtensor_fix.engine.Implementation`).
The engine imports a module when the first Keras module its family patches is
imported; modules here never import one another (``_values`` is shared
Keras-facing argument handling, not a family).
"""
