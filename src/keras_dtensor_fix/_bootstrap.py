"""The package's activation, run once by ``import keras_dtensor_fix`` (which the
interpreter-start hook ``_keras_dtensor_fix_boot`` does at the first import of Keras or
torch). Imports neither torch, nor keras, nor numpy, and never raises."""

from __future__ import annotations

#: Why the last :func:`boot` did or did not activate.
reason = "not booted"


def boot() -> None:
    """Activate the engine unless ``KERAS_DTENSOR_FIX`` says off."""
    global reason
    try:
        from keras_dtensor_fix.engine import config

        cfg = config.load()
        reason = cfg.reason
        if not cfg.enabled:
            return
        from keras_dtensor_fix.engine import patcher

        patcher.activate(cfg, why=cfg.reason)
    except Exception:  # noqa: BLE001 - interpreter start must never fail here
        import logging

        logging.getLogger("keras_dtensor_fix").warning(
            "keras_dtensor_fix: start-up activation failed", exc_info=True
        )
