"""Shared helpers: fresh interpreters, fake patch families, the built wheel."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from support import LAUNCHES, NOTES, ROOT, RunPy, clean_env


def pytest_collection_modifyitems(config, items) -> None:
    """Tests marked ``jax`` skip where jax is not installed (the test extras
    leave it out: ``nox -s tests`` runs them after the suite)."""
    if importlib.util.find_spec("jax") is not None:
        return
    skip = pytest.mark.skip(reason="jax not installed: nox -s tests runs these last")
    for item in items:
        if item.get_closest_marker("jax") is not None:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter) -> None:
    """The slowest process launches (pytest's --durations counts a shared
    launch against the first test that asked for it)."""
    if NOTES:
        terminalreporter.section("measured by the tests")
        for line in NOTES:
            terminalreporter.write_line(line)
    if not LAUNCHES:
        return
    total = sum(seconds for seconds, _ in LAUNCHES)
    terminalreporter.section(f"{len(LAUNCHES)} launches, {total:.0f} s")
    for seconds, what in sorted(LAUNCHES, reverse=True)[:25]:
        terminalreporter.write_line(f"{seconds:7.1f} s  {what[:150]}")


@pytest.fixture
def run_py() -> RunPy:
    """Run ``code`` in a fresh interpreter; returns the CompletedProcess.

    ``env`` overrides variables (``None`` removes one), ``path`` prepends
    folders to ``PYTHONPATH``, ``args`` go before ``-c`` (or ``-m module``),
    ``argv`` after it, ``python`` picks the interpreter, ``src=False`` leaves
    the checkout's ``src`` off ``PYTHONPATH``. Asserts nothing itself.
    """

    def run(
        code: str = "",
        *,
        env: Mapping[str, str | None] | None = None,
        path: Sequence[os.PathLike | str] = (),
        args: Sequence[str] = (),
        python: str | os.PathLike = sys.executable,
        src: bool = True,
        module: str | None = None,
        argv: Sequence[str] = (),
        timeout: float = 300,
    ) -> subprocess.CompletedProcess:
        full = clean_env(env, src=src)
        if path:
            extra = [str(p) for p in path]
            if full.get("PYTHONPATH"):
                extra.append(full["PYTHONPATH"])
            full["PYTHONPATH"] = os.pathsep.join(extra)
        command = [str(python), *args]
        command += ["-m", module] if module else ["-c", textwrap.dedent(code)]
        command += list(argv)
        return subprocess.run(
            command,
            env=full,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(ROOT),
        )

    return run


@pytest.fixture
def lenient_run_py(run_py) -> RunPy:
    """``run_py``, not strict by default: fake families patch missing targets
    on purpose (the engine's tests)."""

    def run(code: str = "", *, env=None, **kwargs) -> subprocess.CompletedProcess:
        return run_py(
            code, env={"KERAS_DTENSOR_FIX_STRICT": None, **(env or {})}, **kwargs
        )

    return run


@pytest.fixture(scope="session")
def mesh1(tmp_path_factory: pytest.TempPathFactory):
    """A one-device torch ``DeviceMesh`` on a world-size-1 gloo group, in-process.

    Imports Keras here (torch backend), activates the plugin and opens its gated
    wrappers, as a sharding distribution would. All of it is undone at the end
    of the session: the group is destroyed, the gate closed, the plugin
    deactivated if it was off before.
    """
    import torch.distributed as dist

    keras_module = sys.modules.get("keras")
    if keras_module is not None and keras_module.backend.backend() != "torch":
        pytest.skip("Keras is already imported here with a non-torch backend")
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    saved = os.environ.get("KERAS_BACKEND")
    os.environ["KERAS_BACKEND"] = "torch"
    try:
        import keras  # noqa: F401
    finally:
        if saved is None:
            del os.environ["KERAS_BACKEND"]
        else:
            os.environ["KERAS_BACKEND"] = saved
    from torch.distributed.device_mesh import init_device_mesh

    import keras_dtensor_fix
    from keras_dtensor_fix.engine import state

    was_active, was_open = keras_dtensor_fix.is_active(), bool(state.SHARDING)
    keras_dtensor_fix.activate()
    store = tmp_path_factory.mktemp("gloo") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    state.note_sharding()
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        if not was_open:
            state.SHARDING.clear()
        dist.destroy_process_group()
        if not was_active:
            keras_dtensor_fix.deactivate()


FAKE_TARGET = """
def add(a, b):
    return a + b


def sub(a, b):
    return a - b


class Base:
    def step(self, x):
        return ("step", x)

    @staticmethod
    def s(x):
        return ("s", x)

    @classmethod
    def c(cls, x):
        return ("c", cls.__name__, x)


class Child(Base):
    pass
"""

FAKE_USER = """
from fake_target import add, sub
"""

FAKE_FAMILY = """
from keras_dtensor_fix.engine.contract import Patch

FAMILY = {family!r}
MODULES = ("fake_target", "fake_late")
GATED = False
CALLS = []


def tag(wrapped, instance, args, kwargs):
    return ("wrapped", wrapped(*args, **kwargs))


def patches(module):
    name = module.__name__
    if name == "fake_late":
        return [Patch(name, "late", tag)]
    return [
        Patch(name, "add", tag, also_in=("fake_user",)),
        Patch(name, "Base.step", tag),
        Patch(name, "Base.s", tag),
        Patch(name, "Base.c", tag),
        Patch(name, "Child.step", tag),
        Patch(name, "missing_function", tag),
    ]


def after_apply():
    CALLS.append("apply")


def after_revert():
    CALLS.append("revert")
"""

FAKE_LATE = """
def late():
    return "late"
"""


@pytest.fixture
def fakes(tmp_path: Path) -> Path:
    """A folder with fake target modules and a fake family ``fake_family``.

    ``fake_family`` (FAMILY "numpy", not gated) patches ``fake_target.add``
    (also bound in ``fake_user``), ``Base.step/s/c``, the inherited
    ``Child.step`` and a missing attribute; ``fake_late`` is for late imports.
    """
    folder = tmp_path / "fakes"
    folder.mkdir()
    (folder / "fake_target.py").write_text(FAKE_TARGET)
    (folder / "fake_user.py").write_text(FAKE_USER)
    (folder / "fake_late.py").write_text(FAKE_LATE)
    (folder / "fake_family.py").write_text(FAKE_FAMILY.format(family="numpy"))
    (folder / "fake_family_data.py").write_text(FAKE_FAMILY.format(family="data"))
    return folder


def _build_wheel(out: Path) -> Path:
    """Build the project's wheel into ``out`` (hatchling if here, else pip)."""
    try:
        import hatchling.build  # noqa: F401

        code = "import sys, hatchling.build as b; print(b.build_wheel(sys.argv[1]))"
        command = [sys.executable, "-c", code, str(out)]
    except ImportError:
        command = [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-w",
            str(out),
            ".",
        ]
    subprocess.run(command, cwd=str(ROOT), check=True, capture_output=True, text=True)
    (wheel,) = out.glob("keras_dtensor_fix-*.whl")
    return wheel


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The project's wheel, built once per test session."""
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="session")
def wheel_venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A new virtual environment with the wheel installed; returns its python.

    It sees this interpreter's site-packages (torch, keras, wrapt) as plain
    path entries, so start-up files there (an editable install's) do not run:
    only the wheel's ``keras_dtensor_fix.pth`` does.
    """
    import sysconfig

    root = tmp_path_factory.mktemp("venv")
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(root)],
        check=True,
        capture_output=True,
    )
    python = root / "bin" / "python"
    site = subprocess.run(
        [
            str(python),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    parents = dict.fromkeys(
        sysconfig.get_paths()[key] for key in ("purelib", "platlib")
    )
    # "_" sorts before "k": these paths are on sys.path when our .pth runs.
    Path(site, "_parent_site.pth").write_text("\n".join(parents) + "\n")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return python
