"""A plan as ``keras.distribution.LayoutMap`` rules a person can read and freeze.

Replicated weights get no rule. A split weight's path becomes a
``re.fullmatch`` regex with layer numbers as ``\\d+`` where every path it
matches splits alike; rules differing in one path component share an
alternation. No two rules match one path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import keras

__all__ = ["PlannedLayoutMap", "rules"]

Axes = tuple[str | None, ...]
_NUMBER = re.compile(r"(?<=_)\d+(?=/|$)")


def rules(assignment: dict[str, Axes], paths: Iterable[str]) -> list[tuple[str, Axes]]:
    """``(regex, axes)`` rules that give every path of ``paths`` its axes."""
    paths = list(paths)
    split = {p: a for p, a in assignment.items() if any(x is not None for x in a)}

    def safe(regex: str, axes: Axes) -> bool:
        return all(split.get(p) == axes for p in paths if re.fullmatch(regex, p))

    found: dict[str, Axes] = {}
    for path, axes in split.items():
        general = _NUMBER.sub(r"\\d+", re.escape(path))
        found[general if safe(general, axes) else re.escape(path)] = axes
    return _merge(found, safe)


def _merge(found: dict[str, Axes], safe) -> list[tuple[str, Axes]]:
    """Rules alike but for one path component share one alternation.

    A merged rule matches exactly the paths its members match, so rules stay
    disjoint; they keep the order of their first member.
    """
    order = {regex: i for i, regex in enumerate(found)}
    groups: dict[tuple, list[tuple[str, str]]] = {}
    for regex, axes in found.items():
        parts = regex.split("/")
        for i, part in enumerate(parts):
            key = (axes, tuple(parts[:i]), tuple(parts[i + 1 :]))
            groups.setdefault(key, []).append((regex, part))
    done: set[str] = set()
    out: list[tuple[int, str, Axes]] = []
    ranked = sorted(groups.items(), key=lambda g: (-len(g[1]), order[g[1][0][0]]))
    for (axes, head, tail), members in ranked:
        if any(regex in done for regex, _ in members):
            continue
        merged = "/".join((*head, f"({'|'.join(p for _, p in members)})", *tail))
        if len(members) == 1:
            merged = members[0][0]
        elif not safe(merged, axes):
            continue
        done.update(regex for regex, _ in members)
        out.append((order[members[0][0]], merged, axes))
    return [(regex, axes) for _, regex, axes in sorted(out)]


class PlannedLayoutMap(keras.distribution.LayoutMap):
    """A LayoutMap that prints as the Python that builds it, and keeps its plan."""

    def __init__(self, device_mesh, plan=None) -> None:
        super().__init__(device_mesh)
        self.plan = plan

    def __repr__(self) -> str:
        mesh = self.device_mesh
        lines = [
            f"# mesh: shape {tuple(mesh.shape)}, axes {list(mesh.axis_names)}",
            "layout_map = keras.distribution.LayoutMap(mesh)",
        ]
        lines += [f'layout_map[r"{k}"] = {tuple(self[k].axes)!r}' for k in self]
        return "\n".join(lines)
