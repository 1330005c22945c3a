"""Sessions: tests, full, tests4, lint, demo, compat, matrix, bench, gpu (nox -s X)."""

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
#: The compatibility matrix (README.md, "Compatibility"): Python, torch,
#: keras-nightly. Every torch and Python at least once, the newest torch with
#: every nightly. torch 2.13.0 on 3.11 is the local CPU wheel; the others are
#: the registry's CUDA builds (about 5.6 GB a venv; they run on the CPU). No
#: keras-nightly with torch ModelParallel installs on Python 3.10 (they need
#: 3.11), and torch 2.15 has no Python 3.10 build.
MATRIX = {
    "py3.11-torch2.13.0-k1027": ("3.11", "2.13.0", KERAS_NIGHTLY),
    "py3.12-torch2.14.1-k1027": ("3.12", "2.14.1", KERAS_NIGHTLY),
    "py3.13-torch2.15.0-k1027": ("3.13", "2.15.0", KERAS_NIGHTLY),
    "py3.12-torch2.15.0-k1015": ("3.12", "2.15.0", "3.16.0.dev2026101504"),
    "py3.13-torch2.15.0-k0910": ("3.13", "2.15.0", "3.16.0.dev2026091004"),
}
RUFF = "ruff==0.17.6"
#: Keras's jax backend, for the test that the plugin stays out of its way.
JAX = "jax"
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
    torch: str = TORCH,
) -> None:
    """Install CPU torch, the pinned keras-nightly and this package (editable)
    in one pip call, then keras-hub without its dependencies."""
    target = f".[{extras}]" if extras else "."
    session.install(torch, f"keras-nightly=={keras}", "-e", target)
    if hub:
        session.install("--no-deps", KERAS_HUB)
        session.install(*KERAS_HUB_NEEDS)


def run_suite(session: nox.Session, marks: str) -> None:
    """pytest on the tests ``marks`` selects, then the ``jax`` ones.

    The single-process tests run two at a time (pytest-xdist, a file per
    worker): most of their time is child interpreters importing torch and
    Keras, one core each. The multi-process tests run one at a time after
    them: each launch keeps both cores busy. pytest's "no tests collected"
    (exit 5) counts as success.
    """
    single = ("tests", "--ignore=tests/multiprocess", "-n", "2", "--dist", "loadfile")
    session.run("pytest", "-m", marks, *single, env=ENV, success_codes=[0, 5])
    multi = ("tests/multiprocess",)
    session.run("pytest", "-m", marks, *multi, env=ENV, success_codes=[0, 5])
    # Keras imports jax (and scipy) whenever it finds them installed: about
    # 2 s more for every process that imports Keras, hundreds in the runs
    # above. They come in afterwards, for the tests marked ``jax`` (Keras's
    # jax and numpy backends), which the runs above skipped.
    session.install(JAX)
    # Single-process tests only: collecting tests/multiprocess imports the
    # scenario cases (Keras, keras-hub and now jax) for nothing.
    jax_tests = ("tests", "--ignore=tests/multiprocess")
    session.run("pytest", "-m", "jax", *jax_tests, env=ENV)


@nox.session
def tests(session: nox.Session) -> None:
    """The test suite CI runs, without the ``slow`` tier (``nox -s full``).

    Arguments after ``--`` go to one plain pytest run instead.
    """
    install(session, hub=True)
    if session.posargs:
        session.run("pytest", *session.posargs, env=ENV, success_codes=[0, 5])
        return
    run_suite(session, "not slow")


@nox.session
def full(session: nox.Session) -> None:
    """Every test of ``nox -s tests`` and the ``slow`` tier: the variants
    whose paths the default run already takes (other meshes, sibling models,
    the same fault met another way). The 4-process cases: ``nox -s tests4``."""
    install(session, hub=True)
    run_suite(session, "slow or not slow")


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
        "tests/multiprocess/test_parity.py",
        "tests/multiprocess/test_saving.py",
        "tests/multiprocess/test_resume.py",
        "tests/multiprocess/test_uneven_data.py",
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
@nox.parametrize("python,torch,keras", list(MATRIX.values()), ids=list(MATRIX))
def matrix(session: nox.Session, torch: str, keras: str) -> None:
    """The multi-process tests and the torch-version test on one row of MATRIX.

    ``nox -s "matrix(py3.12-torch2.14.1-k1027)" -R`` runs one row (Pythons
    found on PATH, e.g. ``PYENV_VERSION=3.11.7:3.12.1:3.13.0`` with pyenv).
    """
    install(session, keras=keras, hub=True, torch=f"torch=={torch}")
    versions = (
        "import platform, keras, torch; "
        "print('matrix:', platform.python_version(), torch.__version__, "
        "keras.version())"
    )
    session.run("python", "-c", versions, env=ENV)
    session.run(
        "pytest",
        "tests/multiprocess",
        "tests/test_bad_inputs.py::test_torch_too_old_to_compile",
        *session.posargs,
        env=ENV,
    )


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark: MLP and transformer block (arguments after ``--`` go to
    benchmarks/bench.py); ``-- --models hub [ARGS]``: keras-hub models with
    fit() and the width plot (benchmarks/hub.py, ARGS to it). Not in CI."""
    args = list(session.posargs)
    hub = None
    for i, arg in enumerate(args):
        if arg == "--models=hub":
            hub = args[:i] + args[i + 1 :]
        elif arg == "--models" and args[i + 1 : i + 2] == ["hub"]:
            hub = args[:i] + args[i + 2 :]
    install(session, hub=hub is not None)
    if hub is None:
        session.run("python", "benchmarks/bench.py", *args, env=ENV)
        return
    session.install("matplotlib")  # the plot; a benchmark-only dependency
    session.run("python", "benchmarks/hub.py", *hub, env=ENV)


@nox.session
def gpu(session: nox.Session) -> None:
    """The one-GPU checks (benchmarks/gpu_check.py): one process, plugin on =
    off on CUDA, eager and compiled, the demo's model. On Linux the registry's
    torch wheel is the CUDA build; without a CUDA device the check says so in
    one line and passes. Not in CI."""
    session.install(TORCH)
    session.install(f"keras-nightly=={KERAS_NIGHTLY}")
    session.install("-e", ".")
    session.run("python", "benchmarks/gpu_check.py", *session.posargs, env=ENV)
