"""Whether this install can run ModelParallel on Keras's torch backend, told without
importing Keras; each problem one sentence with the commands that fix it."""

from __future__ import annotations

import json
import os

from keras_dtensor_fix.engine import targets

#: The keras-nightly this plugin is tested with (README's "Install").
NIGHTLY = "3.16.0.dev2026102704"
INSTALL_NIGHTLY = f"pip install keras-nightly=={NIGHTLY}"


def configured_backend() -> tuple[str, str]:
    """``(backend, where it comes from)``, as Keras will choose it on import."""
    if imported := targets.backend():
        return imported, "the imported Keras"
    if configured := os.environ.get("KERAS_BACKEND"):
        return configured, "KERAS_BACKEND"
    home = os.environ.get("KERAS_HOME") or os.path.expanduser("~/.keras")
    path = os.path.join(home, "keras.json")
    try:
        with open(path, encoding="utf-8") as handle:
            return str(json.load(handle)["backend"]), path
    except (OSError, ValueError, KeyError, TypeError):
        return "tensorflow", "Keras's default, as KERAS_BACKEND is unset"


def keras_problem() -> str | None:
    """Why this Keras build cannot run ModelParallel on torch, with the fix."""
    installed = dict(targets.installed_keras())
    if not installed:
        return f"Keras is not installed: run `{INSTALL_NIGHTLY}`"
    if targets.distribution_support() is not False:
        return None
    version, dist = targets.keras_version()
    why = f"{dist} {version} has no ModelParallel on torch"
    if dist == "keras" and "keras-nightly" in installed:
        over = f"keras {version} is installed over keras-nightly"
        why = f"{over} {installed['keras-nightly']} and replaced its files; {why}"
    uninstall = " ".join(sorted(installed))
    return f"{why}: run `pip uninstall -y {uninstall}`, then `{INSTALL_NIGHTLY}`"


def backend_problem() -> str | None:
    """Why the plugin would patch nothing in a script started now, if so."""
    backend, source = configured_backend()
    if backend == "torch":
        return None
    return (
        f"Keras's backend is {backend!r} ({source}), not 'torch': the plugin "
        "changes nothing; run `export KERAS_BACKEND=torch`"
    )
