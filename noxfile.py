"""Sessions: tests, lint, demo, compat, bench (``nox -s NAME``)."""

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

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "virtualenv"

ENV = {"KERAS_BACKEND": "torch"}


def install(
    session: nox.Session, keras: str = KERAS_NIGHTLY, extras: str = "test"
) -> None:
    """Install CPU torch, the pinned keras-nightly, then this package (editable)."""
    session.install(TORCH)
    session.install(f"keras-nightly=={keras}")
    target = f".[{extras}]" if extras else "."
    session.install("-e", target)


@nox.session
def tests(session: nox.Session) -> None:
    """Run the test suite (pytest's "no tests collected" counts as success)."""
    install(session)
    session.run("pytest", *session.posargs, env=ENV, success_codes=[0, 5])


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
    install(session, keras=keras)
    session.run(
        "pytest", "tests/multiprocess", *session.posargs, env=ENV, success_codes=[0, 5]
    )


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark (arguments after ``--`` go to benchmarks/bench.py)."""
    install(session)
    session.run("python", "benchmarks/bench.py", *session.posargs, env=ENV)
