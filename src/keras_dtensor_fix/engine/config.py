"""Environment configuration, parsed in one place; standard library only (it runs at
interpreter start).

``KERAS_DTENSOR_FIX`` (on/off, parsed by the start-up hook's :func:`parse_enabled`),
``KERAS_DTENSOR_FIX_DISABLE`` (families off), ``KERAS_DTENSOR_FIX_STRICT`` (a patch that
cannot apply raises), ``KERAS_DTENSOR_FIX_SAVE_TIMEOUT`` (the wait for a shared save's
writer) and ``KERAS_DTENSOR_FIX_COMPILE`` (what ``jit_compile=True`` compiles)."""

from __future__ import annotations

import functools
import os
import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from keras_dtensor_fix.engine import families as _families

try:  # the one parser of KERAS_DTENSOR_FIX
    from _keras_dtensor_fix_boot import (
        ENV_ENABLE,
        OFF_VALUES,  # noqa: F401 - part of this module's interface
        ON_VALUES,
        parse_enabled,
    )
except ImportError as error:  # an install's hook older than its package
    raise ImportError(
        "keras-dtensor-fix: the start-up hook _keras_dtensor_fix_boot.py in "
        "site-packages is missing or older than the package; reinstall the "
        "package (`pip install -e .` for a checkout)"
    ) from error

ENV_DISABLE = "KERAS_DTENSOR_FIX_DISABLE"
ENV_STRICT = "KERAS_DTENSOR_FIX_STRICT"
ENV_SAVE_TIMEOUT = "KERAS_DTENSOR_FIX_SAVE_TIMEOUT"
ENV_COMPILE = "KERAS_DTENSOR_FIX_COMPILE"
#: What ``jit_compile=True`` compiles under ModelParallel: ``auto`` (the
#: default: block by block where the model repeats blocks, else whole), the
#: whole step, or each repeated block once.
COMPILE_MODES: tuple[str, ...] = ("auto", "step", "blocks")
DEFAULT_SAVE_SECONDS = 900.0

#: Every patch family's name (the table is :mod:`keras_dtensor_fix.engine.families`).
FAMILIES: tuple[str, ...] = _families.names()

ALL = "*"


@dataclass(frozen=True)
class Config:
    """The parsed environment."""

    enabled: bool
    reason: str
    disabled: frozenset[str]
    warnings: tuple[str, ...] = ()
    disable_all: bool = False
    strict: bool = False

    def family_enabled(self, family: str) -> bool:
        """Whether ``family`` may be patched under this configuration."""
        return not self.disable_all and family not in self.disabled


def parse_disable(raw: str | None) -> tuple[frozenset[str], str | None]:
    """Parse ``KERAS_DTENSOR_FIX_DISABLE``: ``(disabled families, warning)``; ``*``
    disables every family."""
    names = {name for item in (raw or "").split(",") if (name := item.strip().lower())}
    if ALL in names:
        return frozenset((*FAMILIES, ALL)), None
    unknown = sorted(names - set(FAMILIES))
    disabled = frozenset(names & set(FAMILIES))
    if not unknown:
        return disabled, None
    message = (
        f"{ENV_DISABLE} names unknown patch families {', '.join(unknown)}; "
        f"known families are {', '.join(FAMILIES)} (or {ALL} for all); "
        "ignoring the unknown names"
    )
    return disabled, message


@functools.cache
def _parse(enable: str | None, disable: str | None, strict: str | None) -> Config:
    enabled, reason, enable_warning = parse_enabled(enable)
    disabled, disable_warning = parse_disable(disable)
    messages = tuple(m for m in (enable_warning, disable_warning) if m)
    on = (strict or "").strip().lower() in ON_VALUES
    return Config(enabled, reason, disabled - {ALL}, messages, ALL in disabled, on)


_warned: set[tuple[str | None, ...]] = set()
_lock = threading.Lock()


def load(environ: Mapping[str, str] | None = None, *, warn: bool = True) -> Config:
    """Read the configuration from ``environ``; each distinct value is parsed once per
    process, so a malformed one warns once."""
    env = os.environ if environ is None else environ
    key = (env.get(ENV_ENABLE), env.get(ENV_DISABLE), env.get(ENV_STRICT))
    config = _parse(*key)
    with _lock:
        emit = warn and key not in _warned
        if emit:
            _warned.add(key)
    if emit:
        for message in config.warnings:
            warnings.warn(message, RuntimeWarning, stacklevel=2)
    return config


def _ignored(name: str, raw: str, why: str) -> None:
    """Warn, at the caller's caller, that ``name``'s value is not used."""
    warnings.warn(f"keras-dtensor-fix: {name}={raw!r} {why}.", stacklevel=3)


def save_seconds(environ: Mapping[str, str] | None = None) -> float:
    """``KERAS_DTENSOR_FIX_SAVE_TIMEOUT`` in seconds, read at each save; a bad value
    warns and :data:`DEFAULT_SAVE_SECONDS` stands."""
    raw = (os.environ if environ is None else environ).get(ENV_SAVE_TIMEOUT, "")
    try:
        seconds = float(raw) if raw.strip() else DEFAULT_SAVE_SECONDS
    except ValueError:
        seconds = -1.0
    if seconds > 0:
        return seconds
    why = f"is not a positive number of seconds; using {DEFAULT_SAVE_SECONDS:g}"
    _ignored(ENV_SAVE_TIMEOUT, raw, why)
    return DEFAULT_SAVE_SECONDS


def compile_mode(environ: Mapping[str, str] | None = None) -> str:
    """``KERAS_DTENSOR_FIX_COMPILE``, one of :data:`COMPILE_MODES`, read when a step is
    built; a value not understood warns and ``auto`` stands."""
    raw = (os.environ if environ is None else environ).get(ENV_COMPILE, "")
    value = raw.strip().lower() or COMPILE_MODES[0]
    if value in COMPILE_MODES:
        return value
    accepted = f"accepted values are {', '.join(COMPILE_MODES)}"
    _ignored(
        ENV_COMPILE, raw, f"is not understood; {accepted}; using {COMPILE_MODES[0]}"
    )
    return COMPILE_MODES[0]
