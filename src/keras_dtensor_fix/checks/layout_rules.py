"""A LayoutMap rule that matches no variable warns, once per rule and map.

Keras replicates a variable that no rule ``re.fullmatch``-es: a rule with a
typo shards nothing, silently. When a model builds a step, each rule that
none of the variables seen under that map matches warns, naming the nearest
paths. keras-hub's ``get_layout_map`` covers a family of models with rules
some lack: its rules for the backbone are never warned of, added ones are.
"""

from __future__ import annotations

import difflib
import re
import warnings
import weakref
from typing import Any

#: By the LayoutMap's id (unhashable), dropped when it dies: its rules judged
#: (matched or warned of) and keras-hub's (never judged).
_SEEN: dict[int, tuple[set[str], set[str]]] = {}


def variables(model: Any) -> list[Any]:
    """Every variable of ``model``'s step, in one order on every process: its
    own, its optimizer's, its metrics'."""
    optimizer = getattr(model, "optimizer", None)
    return [
        *(getattr(model, "variables", None) or ()),
        *(getattr(optimizer, "variables", None) or ()),
        *(getattr(model, "metrics_variables", None) or ()),
    ]


def _matches(rule: str, path: str) -> bool:
    """Keras's own test: the exact key, else a full regex match."""
    if rule == path:
        return True
    try:
        return re.fullmatch(rule, path) is not None
    except re.error:
        return False


def nearest(rule: str, paths: list[str], count: int = 3) -> list[str]:
    """The variable paths most like ``rule`` (its regex syntax set aside)."""
    plain = re.sub(r"\.\*|\.\+|[\\^$()\[\]?*+|]", "", rule)
    return difflib.get_close_matches(plain, paths, n=count, cutoff=0.0)


def _library_rules(model: Any, distribution: Any) -> set[str] | None:
    """The rules ``get_layout_map`` gives ``model``'s keras-hub backbone
    (empty without one; None where it cannot be asked)."""
    get = getattr(type(getattr(model, "backbone", model)), "get_layout_map", None)
    if get is None:
        return set()
    mesh = distribution.device_mesh
    names = list(mesh.axis_names)
    batch = getattr(distribution, "batch_dim_name", names[0])
    others = [name for name in names if name != batch] or [batch]
    for axes in (
        {},
        {"model_parallel_dim_name": others[0], "data_parallel_dim_name": batch},
    ):
        try:
            return {rule for rule in get(mesh, **axes) if isinstance(rule, str)}
        except Exception:  # noqa: BLE001, S112 - not asked then: nothing is judged
            continue
    return None


def warn_unmatched(model: Any, distribution: Any | None) -> list[str]:
    """Warn of each rule of ``distribution``'s LayoutMap that no variable seen
    so far matches (once per rule and map); the rules warned of now. A model
    without variables yet is not judged."""
    if (layout_map := getattr(distribution, "_layout_map", None)) is None:
        return []  # train_on_batch asks at every step
    judged, library = _SEEN.get(id(layout_map), (set(), set()))
    if all(r in judged or r in library for r in layout_map if isinstance(r, str)):
        return []  # every rule judged: later steps pay one look each
    paths = [path for v in variables(model) if (path := getattr(v, "path", None))]
    if not paths or not getattr(model, "built", True):
        return []
    if (found := _library_rules(model, distribution)) is None:
        return []
    if id(layout_map) not in _SEEN:
        _SEEN[id(layout_map)] = (judged, library)
        weakref.finalize(layout_map, _SEEN.pop, id(layout_map), None)
    library |= found
    rules = [r for r in layout_map if isinstance(r, str) and r not in found]
    unmatched = [
        r for r in rules if r not in judged and not any(_matches(r, p) for p in paths)
    ]
    judged.update(rules)
    for rule in unmatched:
        close = nearest(rule, paths)
        example = ".*" + "/".join(close[0].split("/")[-2:])
        warnings.warn(
            f"keras-dtensor-fix: the LayoutMap rule {rule!r} matches none of "
            f"the {len(paths)} variables of model {getattr(model, 'name', '?')!r} "
            "(nor of any model built before it under this LayoutMap): the "
            "variables it was meant for are replicated, not sharded. Nearest "
            f"variable paths: {', '.join(map(repr, close))}. What to do: write "
            f"the rule as a regex that fully matches a path ({example!r} "
            f"matches {close[0]!r}), or remove it.",
            stacklevel=3,
        )
    return unmatched
