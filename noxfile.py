"""Sessions: tests, tests4, lint, demo, compat, bench (``nox -s NAME``)."""

from __future__ import annotations

import nox

# CPU build: pip takes it from the local wheel directory where there is one.
TORCH = "torch==2.13.0"
KERAS_NIGHTLY = "3.16.0.dev2026102704"
COMPAT_KERAS_NIGHTLIES = (
    "3.16.0.dev2026091004",  # old layout: keras.src.backend.torch.numpy
    "3.16.0.dev2026101504",
    KERAS_NIGHTLY,  # new layout: keras.src.backend.torch.ops.numpy
)
RUFF = "ruff==0.17.6"
# keras-hub's distribution requires `keras`, which would overwrite keras-nightly
# (both own keras/): it goes in with --no-deps, then what it imports. grain
# feeds fit() numpy input; the tests feed token ids, so no tokenizer runs.
KERAS_HUB = "keras-hub-nightly==0.33.0.dev202610250352"
KERAS_HUB_NEEDS = ("regex", "tokenizers", "grain", "rich", "absl-py", "packaging")

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "virtualenv"

ENV = {"KERAS_BACKEND": "torch"}


def install(
    session: nox.Session,
    keras: str = KERAS_NIGHTLY,
    extras: str = "test",
    hub: bool = False,
) -> None:
    """Install CPU torch, the pinned keras-nightly, then this package (editable)."""
    session.install(TORCH)
    session.install(f"keras-nightly=={keras}")
    target = f".[{extras}]" if extras else "."
    session.install("-e", target)
    if hub:
        session.install("--no-deps", KERAS_HUB)
        session.install(*KERAS_HUB_NEEDS)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (pytest's "no tests collected" counts as success)."""
    install(session, hub=True)
    session.run("pytest", *session.posargs, env=ENV, success_codes=[0, 5])


@nox.session
def tests4(session: nox.Session) -> None:
    """The 4-process cases ((2, 2) meshes): slow on 2 cores, not in the default run."""
    install(session, hub=True)
    four = {
        **ENV,
        "KERAS_DTENSOR_FIX_FOUR_RANKS": "1",
        "CHECKPOINT_FOUR_RANKS": "1",
    }
    session.run(
        "pytest",
        "tests/multiprocess/test_hub.py",
        "tests/multiprocess/test_checkpoint.py",
        "-k",
        "four",
        *session.posargs,
        env=four,
    )


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check and ruff format --check."""
    session.install(RUFF)
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session
def demo(session: nox.Session) -> None:
    """The two-process demonstration on the CPU (no test extras: jax is big)."""
    install(session, extras="")
    session.run("python", "-m", "keras_dtensor_fix", "demo", *session.posargs, env=ENV)


@nox.session
@nox.parametrize("keras", COMPAT_KERAS_NIGHTLIES)
def compat(session: nox.Session, keras: str) -> None:
    """The multi-process tests against several keras-nightly builds."""
    install(session, keras=keras, hub=True)
    session.run(
        "pytest", "tests/multiprocess", *session.posargs, env=ENV, success_codes=[0, 5]
    )


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark (arguments after ``--`` go to benchmarks/bench.py)."""
    install(session)
    session.run("python", "benchmarks/bench.py", *session.posargs, env=ENV)
