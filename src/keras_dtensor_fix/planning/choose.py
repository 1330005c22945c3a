"""Which weight axis each mesh axis splits: Megatron's pairing, read off a dataflow.

In call order, a product ``B`` whose other operand only products ``A`` reach
becomes **row** parallel and those ``A`` **column** parallel, unless an ``A``
is already row, bypasses ``B`` (a residual) or an axis does not divide. Large
tables split by vocabulary and a large widening head by its output; column
biases follow; the rest stays replicated. A batch axis splits the other
(hidden) axis of every split weight. docs/planner.md has the rules in full.
"""

from __future__ import annotations

from dataclasses import dataclass

from keras_dtensor_fix.planning.dataflow import Dataflow, Product

__all__ = ["LARGE", "Choice", "choose"]

#: The share of the model's bytes that makes a lone weight worth a collective.
LARGE = 0.05


@dataclass(frozen=True)
class Choice:
    """One weight's split: ``axes`` holds a mesh axis name or None per weight axis."""

    axes: tuple[str | None, ...]
    role: str  # column, row, vocabulary, head, bias, replicated
    why: str


def choose(
    flow: Dataflow,
    shapes: dict[str, tuple[int, ...]],
    nbytes: dict[str, int],
    mesh: dict[str, int],
    model_axis: str = "model",
    batch_axis: str = "batch",
) -> dict[str, Choice]:
    """A :class:`Choice` for every weight of ``shapes``, by name."""
    n = mesh[model_axis]
    roles = _pair(flow, shapes, n)
    consumers = flow.consumers()
    total = sum(nbytes.values()) or 1

    def large(p: Product, axis: int) -> bool:  # worth its collective, and divides
        return nbytes[p.weight] >= LARGE * total and shapes[p.weight][axis] % n == 0

    # weight -> {(role, weight axis): the product asking}
    asks: dict[str, dict[tuple[str, int], Product]] = {}
    for p in flow.products:
        if p.index in roles:
            ask = roles[p.index]
        elif p.kind == "lookup" and large(p, p.contracted[0]):
            ask = ("vocabulary", p.contracted[0])
        elif _head(p, consumers, shapes) and large(p, p.output[0]):
            ask = ("head", p.output[0])
        else:
            ask = ("replicated", -1)
        asks.setdefault(p.weight, {}).setdefault(ask, p)
    choices: dict[str, Choice] = {}
    for name, shape in shapes.items():
        wanted = asks.get(name, {})
        axes_wanted = {a for _, a in wanted}
        if len(axes_wanted) != 1 or -1 in axes_wanted:
            why = "its uses disagree" if len(axes_wanted) > 1 else "no split pays"
            choices[name] = Choice((None,) * len(shape), "replicated", why)
            continue
        # a tied head takes its table's role
        (role, axis), p = min(wanted.items(), key=lambda item: item[0][0] == "head")
        axes = [None] * len(shape)
        axes[axis] = model_axis
        other = _hidden_axis(p, role, axis)
        if (b := mesh.get(batch_axis)) and other is not None and shape[other] % b == 0:
            axes[other] = batch_axis
        choices[name] = Choice(tuple(axes), role, _WHY[role])
    _biases(flow, shapes, choices, model_axis)
    return choices


_WHY = {
    "column": "its output feeds a row-parallel product",
    "row": "it reads only column-parallel outputs",
    "vocabulary": "a large table, split by rows",
    "head": "a large product no product reads",
}


def _pair(
    flow: Dataflow, shapes: dict[str, tuple[int, ...]], n: int
) -> dict[int, tuple[str, int]]:
    """Product index -> ("column" or "row", the weight axis split), in call order."""
    roles: dict[int, tuple[str, int]] = {}
    bypass = flow.bypassing()
    products = flow.products
    for b in products:
        if b.kind != "matmul" or not b.contracted:
            continue
        sources = [products[a] for a in sorted(b.inputs)]
        sources = [a for a in sources if a.kind == "matmul"]
        if not sources or any(
            roles.get(a.index, ("",))[0] == "row" or a.index in bypass for a in sources
        ):
            continue
        if shapes[b.weight][b.contracted[0]] % n:
            continue
        split = {a.index: _column_axis(a, b, shapes, n) for a in sources}
        split = {index: axis for index, axis in split.items() if axis is not None}
        if not split:
            continue
        roles[b.index] = ("row", b.contracted[0])
        for index, axis in split.items():
            roles[index] = ("column", axis)
    return roles


def _column_axis(a: Product, b: Product, shapes, n: int) -> int | None:
    """``a``'s output axis to split for row ``b``: of ``b``'s split size where
    one is (heads, the FFN), never of ``b``'s batch-like axes (experts), else
    the first that divides."""
    b_shape = shapes[b.weight]
    shared = {
        size for i, size in enumerate(b_shape) if i not in b.contracted + b.output
    }
    shape = shapes[a.weight]
    fits = [x for x in a.output if shape[x] % n == 0 and shape[x] not in shared]
    same = [x for x in fits if shape[x] == b_shape[b.contracted[0]]]
    return (same or fits or [None])[0]


def _head(p: Product, consumers, shapes) -> bool:
    """A vocabulary projection: no product reads it, it widens its input."""
    if p.kind != "matmul" or consumers[p.index] or not p.output or not p.contracted:
        return False
    shape = shapes[p.weight]
    return shape[p.output[0]] > shape[p.contracted[0]]


def _hidden_axis(p: Product, role: str, axis: int) -> int | None:
    """The weight axis keras-hub's maps give the batch axis: the hidden one."""
    side = p.contracted if role in ("column", "head") else p.output
    return next((a for a in side if a != axis), None)


def _biases(flow, shapes, choices, model_axis) -> None:
    """A column product's bias splits along with its output axis."""
    for name, index in flow.biases.items():
        p = flow.products[index]
        owner = choices.get(p.weight)
        if name not in shapes or owner is None or owner.role not in ("column", "head"):
            continue
        if tuple(shapes[name]) != tuple(shapes[p.weight][a] for a in p.output):
            continue  # a bias that is not laid out as the output axes
        axes = [None] * len(shapes[name])
        axes[p.output.index(owner.axes.index(model_axis))] = model_axis
        choices[name] = Choice(tuple(axes), "bias", f"follows {p.weight}")
