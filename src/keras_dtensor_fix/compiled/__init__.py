"""Compiled calls' machinery, used by the ``compile`` and ``generate`` families.

``region`` (one compiled piece: static shapes, the cache key, guards skipped,
its failure's one warning and eager fallback), ``failure`` (whether an error
is torch.compile's own), ``plan`` (blocks mode for one model, installed and
undone in order), ``blocks`` (each repeated block compiled once for all its
instances), ``tail`` (in that mode, the layers after the
last block, the loss and the compiled metrics as one region),
``update_groups`` (in that mode, the optimizer's update compiled per block),
``refusals`` (layers a compiled step refuses up front), ``updates`` (whether a
failed compiled step may run again eagerly: did an optimizer count a step),
``steady`` (a compiled function called in a loop, its guard checks skipped
once settled), ``cache_key`` (the compile caches' key tag naming this
process) and ``frames`` (DTensor's subclass methods that a compiled graph's
backward calls, never compiled as frames of their own).
"""
