"""Compiled calls' machinery, used by the ``compile`` and ``generate`` families.

``blocks`` (``KERAS_DTENSOR_FIX_COMPILE=blocks``: each repeated block compiled
once for all its instances), ``updates`` (whether a failed compiled step may
run again eagerly: did an optimizer count a step) and ``steady`` (a compiled
function called in a loop, its guard checks skipped once settled).
"""
