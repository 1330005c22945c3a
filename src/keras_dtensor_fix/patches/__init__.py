"""Patch families: one module per row of :mod:`..families`, each exporting
``IMPLEMENTATION``. Only the engine's loader imports them; they never import
one another (what they share lives in ``ops``, ``dtensor``, ...).
"""
