"""docs/architecture.md's recipes, followed on toys, and the structure they rely on.

A new op handler is a function and one row of ``handlers.HANDLERS``; a new
family is one module under ``patches/`` and one row of ``families.FAMILIES``.
Each toy here is exactly that, and works end to end.
"""

from __future__ import annotations

import ast
import re

from support import ROOT, last_json

PACKAGE = ROOT / "src" / "keras_dtensor_fix"


def test_a_new_op_handler_is_a_function_and_a_row(mesh1, monkeypatch) -> None:
    """The toy row sees its op's arguments by name, rewrites one and hands on."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate

    from keras_dtensor_fix.ops import handlers

    seen = []

    def doubled_y(call: handlers.Call) -> object:
        seen.append(sorted(call.arguments))
        call.arguments["y"] = call.arguments["y"] * 2
        return handlers.NOT_HANDLED

    row = handlers.Handler("doubled_y", lambda op: op.name == "toy_add", doubled_y)
    monkeypatch.setattr(handlers, "HANDLERS", (row, *handlers.HANDLERS))

    def toy_add(x, y):
        return x + y

    wrapper = handlers.wrapper_for("toy_add", toy_add)
    ones = torch.ones(2)
    assert wrapper(toy_add, None, (ones, ones), {}).tolist() == [2.0, 2.0]
    assert seen == []  # no DTensor: the fast path, no handler
    x = DTensor.from_local(torch.ones(2), mesh1, [Replicate()])
    result = wrapper(toy_add, None, (x,), {"y": ones})
    assert seen == [["x", "y"]]
    # The table's later rows ran the rewritten call (y promoted next to x).
    assert isinstance(result, DTensor) and result.full_tensor().tolist() == [3.0, 3.0]
    other = handlers.wrapper_for("add", toy_add)
    other(toy_add, None, (x, ones), {})
    assert seen == [["x", "y"]]  # the row picks its op only


TOY_TARGET = """
def double(x):
    return 2 * x
"""

TOY_FAMILY = '''"""A toy family: what ``double`` returns, tagged."""

from keras_dtensor_fix.engine.contract import Implementation, Patch


def tagged(wrapped, instance, args, kwargs):
    return ("toy", wrapped(*args, **kwargs))


def patches(module):
    return [Patch(module.__name__, "double", tagged)]


IMPLEMENTATION = Implementation(patches)
'''

FAMILY_RECIPE = """
import json, sys
import keras_dtensor_fix as kdf
from keras_dtensor_fix.engine import patcher, families, targets
from keras_dtensor_fix import patches

patches.__path__.append(FAMILY_FOLDER)  # the file, as if in patches/
row = families.Family("toy", ("toy",), "a toy", "toy_family", gated=False)
families.FAMILIES += (row,)  # the row
# Test scaffolding, not the recipe: the toy patches a module that is not Keras's.
targets.MODULES["toy"] = ("toy_target",)
kdf.activate()
early = "keras_dtensor_fix.patches.toy_family" in sys.modules
import toy_target
raw = patcher.original("toy_target", "double")
toy_rows = lambda: [r for r in patcher.rows() if r["family"] == "toy"]
out = {"early": early, "loaded": "keras_dtensor_fix.patches.toy_family" in sys.modules,
       "call": toy_target.double(3), "names": patcher.families(),
       "rows": [[r["state"], r["cause"]] for r in toy_rows()]}
kdf.deactivate()
out.update(restored=toy_target.double is raw, after=toy_target.double(3),
           reverted=[r["state"] for r in toy_rows()])
print(json.dumps(out))
"""


def test_a_new_family_is_a_module_and_a_row(run_py, tmp_path) -> None:
    """The engine loads the toy family lazily, applies it and reverts it by identity."""
    (tmp_path / "family").mkdir()
    (tmp_path / "family" / "toy_family.py").write_text(TOY_FAMILY)
    (tmp_path / "toy_target.py").write_text(TOY_TARGET)
    code = FAMILY_RECIPE.replace("FAMILY_FOLDER", repr(str(tmp_path / "family")))
    # Off at start-up, so that the row is in the table before the engine reads it.
    out = last_json(run_py(code, path=[tmp_path], env={"KERAS_DTENSOR_FIX": "0"}))
    assert not out["early"] and out["loaded"]
    assert out["call"] == ["toy", 6] and out["names"][-1] == "toy"
    assert out["rows"] == [["applied", "wrapped"]]
    assert out["restored"] and out["after"] == 6 and out["reverted"] == ["reverted"]


# -- the structure the recipes rely on ---------------------------------------------


def test_the_handler_order_is_written_once() -> None:
    """ops/handlers.py's docstring numbers every row of HANDLERS, in table order."""
    from keras_dtensor_fix.ops import handlers

    listed = re.findall(r"(\d+)\. ``(\w+)``", handlers.__doc__)
    names = [row.name for row in handlers.HANDLERS]
    assert [name for _, name in listed] == names
    assert [int(number) for number, _ in listed] == list(range(1, len(names) + 1))


def _file(module: str):
    """The source file of ``module``, or None outside the package."""
    path = ROOT / "src" / module.replace(".", "/")
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _imports(path) -> list[tuple[str, str]]:
    """``(module, name)`` for each name a file takes from the package.

    ``from module import name``, and ``alias.name`` where ``alias`` is a module
    of the package imported by ``from package import module``.
    """
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(ROOT / "src").parts[:-1])
    found, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join([*base, module] if module else base)
            for alias in node.names:
                if _file(f"{module}.{alias.name}") is not None:
                    aliases[alias.asname or alias.name] = f"{module}.{alias.name}"
                found.append((module, alias.name))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in aliases:
                found.append((aliases[node.value.id], node.attr))
    return [(m, n) for m, n in found if m.startswith("keras_dtensor_fix")]


def _exported(module: str) -> set[str] | None:
    """The names in ``module``'s ``__all__``, or None if it has none."""
    path = _file(module)
    for node in ast.parse(path.read_text()).body if path else ():
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets
        ):
            return {ast.literal_eval(e) for e in node.value.elts}
    return None


def test_only_the_loader_imports_families() -> None:
    for path in PACKAGE.rglob("*.py"):
        if "patches" not in path.parts:
            imported = {m for m, _ in _imports(path)} | {
                f"{m}.{n}" for m, n in _imports(path)
            }
            assert not any(
                name.startswith("keras_dtensor_fix.patches") for name in imported
            ), path


def test_all_lists_what_other_modules_import() -> None:
    """Names other modules of the package take from a module are in its ``__all__``."""
    missing = set()
    for path in PACKAGE.rglob("*.py"):
        for module, name in _imports(path):
            if name.startswith("_") or _file(f"{module}.{name}") is not None:
                continue  # private, or a submodule
            exported = _exported(module)
            if exported is not None and _file(module) != path and name not in exported:
                missing.add((module, name))
    assert sorted(missing) == []


def test_no_module_is_long() -> None:
    long = {
        path.name: n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > 450
    }
    assert long == {}


def test_an_eager_only_method_leaves_compiled_steps_to_the_original() -> None:
    """A method ``Patch`` not ``traced``: eager calls run the wrapper, dynamo traces
    the original alone (no frame of the plugin per call: the leaves family's
    ``Layer.__call__`` ran a deep MoE model out of recursion depth without
    it), and the original comes back on restore."""
    import torch

    from keras_dtensor_fix.engine import wrappers
    from keras_dtensor_fix.engine.contract import Patch

    calls: list[bool] = []

    class Toy:
        def __call__(self, x):
            return x + 1

    raw = Toy.__call__

    def wrapper(wrapped, instance, args, kwargs):
        calls.append(bool(torch.compiler.is_compiling()))
        return wrapped(*args, **kwargs)

    patch = Patch("toy", "Toy.__call__", wrapper)
    record = wrappers.install("toy", patch, Toy, "__call__", raw)
    try:
        toy = Toy()
        assert Toy.__call__._torchdynamo_inline is raw
        assert toy(torch.ones(2)).tolist() == [2.0, 2.0] and calls == [False]
        compiled = torch.compile(lambda x: toy(x) * 2, backend="eager", fullgraph=True)
        assert compiled(torch.ones(2)).tolist() == [4.0, 4.0]
        assert calls == [False]  # traced: the original only
    finally:
        assert wrappers.restore(record)
    assert Toy.__call__ is raw
