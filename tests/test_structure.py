"""The package's import graph has no circle, imports inside functions included.

An edge is a module naming another of the package in an ``import`` or
``from ... import`` anywhere in its source (a name imported from a package
counts as its submodule when there is one; a module reading its own
package's ``__init__`` is not an edge). A circle means two modules each
need the other to be read: the layers no longer stand one above the other.
No module takes another's ``_names`` either (what another module needs is
public), and the patch families stand below the engine that loads them.
"""

from __future__ import annotations

import ast
from pathlib import Path

from support import SRC

PACKAGE = "keras_dtensor_fix"


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def imported_from(node: ast.ImportFrom, package: str) -> str:
    """The absolute module name of ``from ... import``, relative ones resolved."""
    base = node.module or ""
    if node.level:
        anchor = package.split(".")
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, *([base] if base else [])])
    return base


def edges(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = imported_from(node, package)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        # A module reading its own package (a setting kept on the package)
        # is the package's interface, not an arrow back up.
        found.update(
            t
            for t in targets
            if t in known and t != name and not name.startswith(t + ".")
        )
    return found


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for other in sorted(graph[node]):
            if state.get(other) == "open":
                found.append(stack[stack.index(other) :] + [other])
            elif other not in state:
                visit(other)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return found


def test_no_import_circle() -> None:
    known = modules()
    graph = {name: edges(name, path, known) for name, path in known.items()}
    assert graph[f"{PACKAGE}.report"] >= {f"{PACKAGE}.engine.patcher"}  # sees imports
    assert circles(graph) == []


def test_a_circle_is_found() -> None:
    """Control: the search reports a circle when there is one."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c", "a"]]


def test_families_import_the_contract_not_the_engine() -> None:
    """Families stand below the engine that loads them."""
    known = modules()
    for name, path in known.items():
        if name.startswith(f"{PACKAGE}.patches."):
            found = edges(name, path, known)
            for engine in ("patcher", "loader", "hooks", "wrappers"):
                assert f"{PACKAGE}.engine.{engine}" not in found, (name, engine)


def private_crossings(name: str, source: str, known: dict[str, Path]) -> list[str]:
    """``_names`` that ``source`` (module ``name``) takes from another module of
    the package: ``from m import _x``, or ``m._x`` on a module it imported."""
    package = name.rpartition(".")[0]
    found, modules_here = [], set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = imported_from(node, package)
            if not base.startswith(PACKAGE) or base == name:
                continue
            for alias in node.names:
                if f"{base}.{alias.name}" in known:
                    modules_here.add(alias.asname or alias.name)
                elif alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {base} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE) and alias.asname:
                    modules_here.add(alias.asname)
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules_here
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_private_name_crosses_modules() -> None:
    """A module's ``_names`` are its own: what another module needs is public
    (the ``__all__`` checks skip ``_`` names, so this one looks)."""
    known = modules()
    crossings = {
        name: found
        for name, path in known.items()
        if (found := private_crossings(name, path.read_text(), known))
    }
    assert crossings == {}


def test_a_private_crossing_is_found() -> None:
    """Control: both forms are reported."""
    known = modules()
    source = (
        f"from {PACKAGE}.engine import targets\n"
        f"from {PACKAGE}.dtensor.spec import _spec_internals\n"
        "targets._hidden(1)\n"
    )
    found = private_crossings(f"{PACKAGE}.engine.hooks", source, known)
    assert found == [
        f"from {PACKAGE}.dtensor.spec import _spec_internals",
        "targets._hidden",
    ]


#: keras-hub attribute, parameter and table names generation reads: ``hub/``
#: owns them (``call_with_cache``'s parameters past the token ids and cache,
#: a block's cache keyword, the tables of ``hub/generation.py``).
HUB_NAMES = (
    "transformer_layers",
    "token_embedding",
    "cache_update_index",
    "cache_update_mask",
    "img_embeddings",
    "padding_mask",
    "position_ids",
    "self_attention_cache",
    "ATTENTION_HEADS",
    "SAMPLERS",
    "CALL_WITH_CACHE",
    "CACHE_HEADS",
    "CACHE_ARGUMENTS",
)


def hub_names_in(source: str) -> list[str]:
    """The :data:`HUB_NAMES` ``source`` names other than through the hub room
    (``hub.X``, ``hub.generation.X``, ``from ...hub.generation import X``)."""
    import re

    found = []
    for word in HUB_NAMES:
        for match in re.finditer(rf"(?<!\w){word}\b", source):
            before = source[: match.start()]
            if before.endswith(("hub.", "hub.generation.")):
                continue
            line = before.rpartition("\n")[2]
            if re.match(r"\s*from [\w.]*\bhub\.generation import", line):
                continue
            found.append(word)
    return found


def test_keras_hub_names_live_in_the_hub_room() -> None:
    """A keras-hub release that renames one of them is fixed in ``hub/``
    (other modules name them through it: ``hub.token_embedding``)."""
    outside = [
        (name, word)
        for name, path in modules().items()
        if not name.startswith(f"{PACKAGE}.hub")
        for word in hub_names_in(path.read_text())
    ]
    assert outside == []


def test_a_hub_name_outside_the_room_is_found() -> None:
    """Control: a bare name, an attribute of another object and a keyword are
    found; the hub room's own names are not."""
    source = (
        "from keras_dtensor_fix.hub.generation import CACHE_HEADS\n"
        "CORE = ('token_ids', 'cache', 'cache_update_index')\n"
        "blocks = model.backbone.transformer_layers\n"
        "x = decoder.CACHE_HEADS + hub.CACHE_HEADS + CACHE_HEADS\n"
        "call(img_embeddings=None)\n"
        "n = hub.generation.SAMPLERS\n"
    )
    assert hub_names_in(source) == [
        "transformer_layers",
        "cache_update_index",
        "img_embeddings",
        "CACHE_HEADS",
        "CACHE_HEADS",
    ]


def unnamed_modules(package: Path) -> list[str]:
    """The modules of ``package`` its ``__init__`` docstring does not name."""
    import re

    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return sorted(
        path.stem
        for path in package.glob("*.py")
        if path.stem != "__init__" and not re.search(rf"(?<!\w){path.stem}\b", doc)
    )


def test_each_package_names_its_modules() -> None:
    """Each folder's docstring says what each of its modules is for, so a
    module that does another job shows (``ops/`` names op handling only: the
    compiled calls' modules live in ``compiled/``). ``patches/`` is the
    exception: the family table lists its modules."""
    root = SRC / PACKAGE
    unnamed = {
        package.name: found
        for package in sorted(p.parent for p in root.glob("*/__init__.py"))
        if package.name != "patches" and (found := unnamed_modules(package))
    }
    assert unnamed == {}


def test_an_unnamed_module_is_found(tmp_path: Path) -> None:
    """Control: a module the docstring leaves out is reported."""
    (tmp_path / "__init__.py").write_text('"""``handlers`` and ``call``."""\n')
    for name in ("handlers", "call", "blocks"):
        (tmp_path / f"{name}.py").write_text("")
    assert unnamed_modules(tmp_path) == ["blocks"]


def test_structure_keras_names_families_and_docs() -> None:
    """Keras module names live in targets.py only; no family imports another;
    the developer docs' family table names families of the table, in order
    (adding a family needs no doc: the table is the list)."""
    import re

    from keras_dtensor_fix.engine import families

    spelled = [
        path.name
        for path in (SRC / PACKAGE).rglob("*.py")
        if path.name != "targets.py" and "keras.src." in path.read_text()
    ]
    assert spelled == []
    implementations = {row.implementation for row in families.FAMILIES}
    for name in implementations:
        tree = ast.parse((SRC / PACKAGE / "patches" / f"{name}.py").read_text())
        imported = {
            node.module
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module
        }
        others = {f"keras_dtensor_fix.patches.{n}" for n in implementations - {name}}
        assert not imported & others, (name, imported & others)
    architecture = (SRC.parent / "docs" / "architecture.md").read_text()
    section = architecture.split("## The families")[1].split("\n## ")[0]
    documented = re.findall(r"^\| `(\w+)`", section, re.M)
    assert documented == [name for name in families.names() if name in documented]
    # One row per family, linking its module (whose docstring says what and why).
    assert documented == list(families.names())
    for row in families.FAMILIES:
        link = f"](../src/keras_dtensor_fix/patches/{row.implementation}.py) |"
        assert link in section, row.name
