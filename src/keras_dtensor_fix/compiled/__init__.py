"""Compiled calls' machinery, used by the ``compile`` and ``generate`` families.

``region`` (one compiled piece, its guards skipped once settled), ``failure`` (is an
error torch.compile's own), ``plan`` (blocks mode for one model), ``blocks`` (each
repeated block compiled once for its class), ``tail`` (the layers after the last block
and the loss as one region), ``update_groups`` (the optimizer's update per block),
``refusals`` (what a compiled step refuses up front), ``fallback`` (a failed step run
again eagerly, where it may), ``cache_key`` (the compile caches' per-process tag) and
``frames`` (DTensor's subclass methods never compiled as frames)."""
