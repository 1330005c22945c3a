"""``python -m keras_dtensor_fix plan MODULE:FUNCTION --mesh 1x2``: the plan as a table.

``FUNCTION`` builds the model; ``MODULE`` is a module name or a ``.py`` file.
One row per weight (shape, split, bytes per rank, collectives per step), the
totals, then the rules as Python to paste.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import sys
from typing import Any

__all__ = ["main", "table"]


def _load(target: str) -> Any:
    module_name, _, function = target.rpartition(":")
    if not module_name or not function:
        raise SystemExit(f"expected MODULE:FUNCTION, got {target!r}")
    sys.path.insert(0, os.getcwd())
    if module_name.endswith(".py"):  # as a script: its folder on the path
        sys.path.insert(0, os.path.dirname(os.path.abspath(module_name)))
        spec = importlib.util.spec_from_file_location("_planned", module_name)
        if spec is None or spec.loader is None:
            raise SystemExit(f"cannot load {module_name!r}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    try:
        return getattr(module, function)
    except AttributeError:
        raise SystemExit(f"{module_name} has no {function!r}") from None


def _mesh(text: str, axes: list[str]) -> Any:
    import keras

    try:
        shape = tuple(int(n) for n in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh takes sizes like 1x2, got {text!r}") from None
    if len(shape) != len(axes):
        raise SystemExit(f"--mesh {text} has {len(shape)} axes, --axes names {axes}")
    devices = [f"cpu:{i}" for i in range(math.prod(shape))]  # never started
    return keras.distribution.DeviceMesh(shape, axes, devices)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def table(plan: Any) -> str:
    """The plan's rows and totals as text."""
    cost = plan.cost
    rows = [["WEIGHT", "SHAPE", "SPLIT", "PER RANK", "COLLECTIVES PER STEP"]]
    for path, choice in plan.choices.items():
        collectives = cost.collectives.get(path, [])
        said = "; ".join(f"{what} ({_size(b)})" for what, b in collectives) or "-"
        split = "-"
        if choice.role != "replicated":
            split = f"({', '.join(str(a) for a in choice.axes)}) {choice.role}"
        shape, per = str(plan.traced.shapes[path]), _size(cost.per_rank[path])
        rows.append([path, shape, split, per, said])
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [
        "  ".join([*(c.ljust(w) for c, w in zip(r, widths, strict=False)), r[4]])
        for r in rows
    ]
    lines += [
        "",
        f"weights per rank: {_size(cost.bytes_per_rank)} of "
        f"{_size(cost.bytes_one_process)} ({cost.ratio:.2f}x one process)",
        f"collectives per train step: {cost.count}, moving {_size(cost.moved)} "
        "(on the traced batch)",
    ]
    return "\n".join(line.rstrip() for line in lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m keras_dtensor_fix plan",
        description="Plan a tensor-parallel layout for the model FUNCTION builds.",
    )
    parser.add_argument("target", help="MODULE:FUNCTION (or path/to/file.py:FUNCTION)")
    parser.add_argument("--mesh", default="1x2", help="mesh sizes, e.g. 1x2 or 2x4")
    parser.add_argument(
        "--axes", default="batch,model", help="mesh axis names (default batch,model)"
    )
    parser.add_argument("--model-axis", default="model")
    parser.add_argument("--batch-axis", default="batch")
    args = parser.parse_args(argv)
    build = _load(args.target)
    mesh = _mesh(args.mesh, args.axes.split(","))
    import keras_dtensor_fix

    layout_map = keras_dtensor_fix.auto_layout_map(
        build, mesh, model_axis=args.model_axis, batch_axis=args.batch_axis
    )
    print(f"{table(layout_map.plan)}\n\n{layout_map!r}")
    return 0
