"""KERAS_DTENSOR_FIX and KERAS_DTENSOR_FIX_DISABLE parsing and their effect."""

from __future__ import annotations

import warnings

import pytest
from hypothesis import given
from hypothesis import strategies as st

from keras_dtensor_fix.engine import config
from support import last_json

OFF = ["0", "false", "off", "no", "FALSE", "Off", " no ", "\tNO\n", " 0"]
ON = ["1", "true", "on", "yes", "TRUE", "On", " yes ", "", "   ", None]
GARBAGE = ["maybe", "2", "enable", "0n", "y", "-1", "nope"]


@pytest.mark.parametrize("value", OFF)
def test_off_values(value: str) -> None:
    enabled, reason, warning = config.parse_enabled(value)
    assert not enabled and warning is None
    assert config.ENV_ENABLE in reason


@pytest.mark.parametrize("value", ON)
def test_on_values(value: str | None) -> None:
    enabled, _, warning = config.parse_enabled(value)
    assert enabled and warning is None


@pytest.mark.parametrize("value", GARBAGE)
def test_garbage_warns_and_defaults_on(value: str) -> None:
    env = {config.ENV_ENABLE: value}
    with pytest.warns(RuntimeWarning) as record:
        cfg = config.load(env)
    assert cfg.enabled
    assert len(record) == 1
    message = str(record[0].message)
    assert config.ENV_ENABLE in message and repr(value) in message
    for accepted in (*config.ON_VALUES, *config.OFF_VALUES):
        assert accepted in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config.load(env) is cfg  # warned once per process


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, set()),
        ("", set()),
        (" , ,", set()),
        ("optimizers,numpy,data", {"optimizers", "numpy", "data"}),
        (" Numpy , ,DATA ", {"numpy", "data"}),
        ("compile,variables,promotion", {"compile", "variables", "promotion"}),
    ],
)
def test_disable_lists(value: str | None, expected: set[str]) -> None:
    disabled, warning = config.parse_disable(value)
    assert disabled == expected and warning is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = config.load({config.ENV_DISABLE: value} if value is not None else {})
    assert not cfg.disable_all
    for family in config.FAMILIES:
        assert cfg.family_enabled(family) is (family not in expected)


@pytest.mark.parametrize("value", ["*", " * ", "numpy,*", "*,bogus"])
def test_disable_all(value: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = config.load({config.ENV_DISABLE: value})
    assert cfg.disable_all
    assert not any(cfg.family_enabled(f) for f in (*config.FAMILIES, "extra"))


def test_unknown_families_warn_once_with_known_names() -> None:
    env = {config.ENV_DISABLE: "numpy,bogus, Other ,"}
    with pytest.warns(RuntimeWarning) as record:
        cfg = config.load(env)
    assert len(record) == 1
    message = str(record[0].message)
    assert "bogus" in message and "other" in message
    assert all(family in message for family in config.FAMILIES)
    assert cfg.disabled == {"numpy"}
    assert cfg.enabled


@given(st.text(max_size=20))
def test_any_enable_value_parses(value: str) -> None:
    enabled, reason, warning = config.parse_enabled(value)
    normal = value.strip().lower()
    if normal in config.OFF_VALUES:
        assert not enabled and warning is None
    elif normal in config.ON_VALUES or not normal:
        assert enabled and warning is None
    else:
        assert enabled and warning is not None and config.ENV_ENABLE in warning
    assert reason


@given(st.lists(st.sampled_from([*config.FAMILIES, "x", " ", "NUMPY", "*"])))
def test_any_disable_list_parses(names: list[str]) -> None:
    disabled, warning = config.parse_disable(",".join(names))
    normal = {n.strip().lower() for n in names} - {""}
    if "*" in normal:
        assert warning is None
    else:
        assert disabled == normal & set(config.FAMILIES)
        assert (warning is not None) == bool(normal - set(config.FAMILIES))


STATE = """
import importlib, json
import keras
import keras_dtensor_fix as k
from keras_dtensor_fix.engine import patcher, targets
name = next(m for m in targets.torch_module("numpy") if targets.find_spec(m))
tnp = importlib.import_module(name)
s = k.status()
print(json.dumps({"active": k.is_active(), "why": s["why"],
    "wrapped": patcher.chain_length(tnp.add),
    "applied": [r for r in s["targets"] if r["state"] == "applied"],
    "disabled": [r["family"] for r in s["targets"] if r["state"] == "disabled"],
    "warnings": s["warnings"]}))
"""


# A fresh interpreter per value: the import-time wiring of parse_enabled,
# whose every value test_off_values and test_on_values check in-process.
@pytest.mark.parametrize("value", ["0", " No "])
def test_env_off_patches_nothing(run_py, value: str) -> None:
    out = last_json(run_py(STATE, env={"KERAS_DTENSOR_FIX": value}))
    assert not out["active"]
    assert out["wrapped"] == 0 and out["applied"] == []
    assert "KERAS_DTENSOR_FIX" in out["why"]


@pytest.mark.parametrize("value", ["", " true "])
def test_env_on_activates(run_py, value: str) -> None:
    out = last_json(run_py(STATE, env={"KERAS_DTENSOR_FIX": value}))
    assert out["active"] and out["warnings"] == []


def test_env_garbage_warns_once_and_activates(run_py) -> None:
    proc = run_py(STATE, env={"KERAS_DTENSOR_FIX": "maybe"})
    out = last_json(proc)
    assert out["active"]
    assert proc.stderr.count("KERAS_DTENSOR_FIX='maybe'") == 1, proc.stderr
    assert "RuntimeWarning" in proc.stderr
    assert any("maybe" in w for w in out["warnings"])


def test_env_disable_star_disables_every_family(run_py) -> None:
    out = last_json(run_py(STATE, env={"KERAS_DTENSOR_FIX_DISABLE": "*"}))
    assert out["active"] and out["applied"] == [] and out["wrapped"] == 0


def test_env_disable_unknown_warns(run_py) -> None:
    proc = run_py(STATE, env={"KERAS_DTENSOR_FIX_DISABLE": "numpy,bogus"})
    out = last_json(proc)
    assert proc.stderr.count("bogus") == 1, proc.stderr
    assert out["wrapped"] == 0
    assert all(row["family"] != "numpy" for row in out["applied"])


def test_an_older_start_up_hook_is_named(run_py, tmp_path) -> None:
    """The package parses ``KERAS_DTENSOR_FIX`` with the hook's parser: an
    install whose hook predates it warns what to reinstall and stays off."""
    (tmp_path / "_keras_dtensor_fix_boot.py").write_text("def boot():\n    pass\n")
    code = "import json, keras_dtensor_fix as kdf; print(json.dumps(kdf.is_active()))"
    proc = run_py(code, path=[tmp_path])
    assert last_json(proc) is False
    assert "older than the package; reinstall" in proc.stderr, proc.stderr
