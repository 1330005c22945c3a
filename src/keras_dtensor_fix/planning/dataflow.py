"""Which weight feeds which: one traced forward, read as a graph of products.

Pure torch. A ``TorchFunctionMode`` watches one forward: a tensor derived
from a weight (cast, transpose, reshape) knows the weight and which weight
axis each dim is; any other tensor knows the *products* (a matmul, einsum or
linear with one weight operand, an embedding lookup, a convolution) whose
outputs reach it. A weight added to a product's output is its bias; a
product *bypasses* when its output meets a downstream product's, unconsumed
(a residual).
"""

from __future__ import annotations

import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["Dataflow", "Product", "trace"]

F = torch.nn.functional
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm}
_MATMULS |= {torch.bmm, torch.Tensor.mm, torch.Tensor.bmm, torch.Tensor.__rmatmul__}
_LOOKUPS = {F.embedding, torch.index_select, torch.Tensor.index_select}
_CONVS = {F.conv1d, F.conv2d, F.conv3d}
_CONVS |= {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d}
_PERMUTES = {torch.permute, torch.Tensor.permute}
_TRANSPOSES = {torch.transpose, torch.Tensor.transpose, torch.swapaxes}
_TRANSPOSES |= {torch.Tensor.swapaxes}
_FLIPS = {torch.t, torch.Tensor.t, torch.Tensor.T.__get__, torch.Tensor.mT.__get__}
_ADDS = {torch.add, torch.Tensor.add, torch.Tensor.__add__, torch.Tensor.__radd__}
_ADDS |= {torch.Tensor.add_, torch.Tensor.__iadd__}
#: Ops that copy a tensor as it is (a product's output stays one, for its bias).
_COPIES = {"to", "type", "contiguous", "clone", "detach", "float", "empty_like"}


@dataclass(frozen=True)
class Product:
    """One weight read by one op of the forward."""

    index: int
    weight: str
    kind: str  # "matmul", "lookup" or "conv"
    contracted: tuple[int, ...]  # weight axes summed over (a lookup's: indexed)
    output: tuple[int, ...]  # weight axes that reach the output only
    inputs: frozenset[int]  # products whose outputs reach the other operand
    in_numel: int  # elements of the other operand (an activation)
    out_numel: int  # elements of the output


@dataclass
class Dataflow:
    """The products of one forward, in call order, and what links them."""

    products: list[Product] = field(default_factory=list)
    biases: dict[str, int] = field(default_factory=dict)  # weight -> product
    sources: set[frozenset[int]] = field(default_factory=set)

    def consumers(self) -> dict[int, set[int]]:
        """Product -> the products whose other operand it reaches."""
        out: dict[int, set[int]] = {p.index: set() for p in self.products}
        for product in self.products:
            for source in product.inputs:
                out[source].add(product.index)
        return out

    def bypassing(self) -> set[int]:
        """Products whose output meets a downstream product's, unconsumed."""
        consumers = self.consumers()
        downstream: dict[int, set[int]] = {}
        for product in reversed(self.products):  # consumers come later
            reach = set()
            for c in consumers[product.index]:
                reach |= {c} | downstream[c]
            downstream[product.index] = reach
        return {
            a for src in self.sources for a in src if not downstream[a].isdisjoint(src)
        }


def trace(
    run: Callable[[], Any], weights: dict[int, tuple[str, torch.Tensor]]
) -> Dataflow:
    """Run ``run()`` once, watching; ``weights``: ``id(tensor)`` -> (name, tensor)."""
    mode = _Watch(weights)
    with mode:
        run()
    return mode.flow


class _Watch(TorchFunctionMode):
    def __init__(self, weights: dict[int, tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        self.flow = Dataflow()
        # id -> (weight name, weight axis per dim or None where unknown)
        self.derived: dict[int, tuple[str, tuple[int | None, ...]]] = {
            key: (name, tuple(range(t.ndim))) for key, (name, t) in weights.items()
        }
        self.src: dict[int, frozenset[int]] = {}
        self.outputs: dict[int, int] = {}  # id of a product's output -> its index
        self.alive: list[Any] = [t for _, t in weights.values()]  # ids stay unique

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = [
            x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)
        ]
        if not leaves:
            return out
        results = [x for x in tree_flatten(out)[0] if isinstance(x, torch.Tensor)]
        self.alive += leaves + results
        weighted = [t for t in leaves if id(t) in self.derived]
        others = [t for t in leaves if id(t) not in self.derived]
        src = frozenset().union(*(self.src.get(id(t), frozenset()) for t in others))
        product = None
        if len(weighted) == 1 and others:
            product = self._product(func, args, kwargs, weighted[0], others, src, out)
        if product is not None:
            self.flow.products.append(product)
            for r in results:
                self.src[id(r)] = frozenset({product.index})
                self.outputs[id(r)] = product.index
            return out
        if len(weighted) == 1 and not others and len(results) == 1:
            self._derive(func, args, weighted[0], results[0])
        elif len(weighted) == 1 and func in _ADDS:
            owners = {self.outputs[id(t)] for t in others if id(t) in self.outputs}
            if len(owners) == 1:
                self.flow.biases.setdefault(
                    self.derived[id(weighted[0])][0], owners.pop()
                )
        elif len(leaves) == 1 and id(leaves[0]) in self.outputs and len(results) == 1:
            if getattr(func, "__name__", "") in _COPIES:
                self.outputs[id(results[0])] = self.outputs[id(leaves[0])]
        if src:
            self.flow.sources.add(src)
            for r in results:
                self.src[id(r)] = src
        return out

    def _derive(self, func, args, tensor, result) -> None:
        name, axes = self.derived[id(tensor)]
        if func in _PERMUTES:
            dims = (
                args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
            )
            new = tuple(axes[d] for d in dims)
        elif func in _TRANSPOSES:
            new = list(axes)
            a, b = args[1] % len(axes), args[2] % len(axes)
            new[a], new[b] = new[b], new[a]
            new = tuple(new)
        elif func in _FLIPS:
            new = axes[:-2] + axes[-2:][::-1]
        elif tuple(result.shape) == tuple(tensor.shape):
            new = axes  # a cast, a copy, an elementwise op with a constant
        else:
            new = (None,) * result.ndim  # a reshape: the weight, axes unknown
        self.derived[id(result)] = (name, new)

    def _product(self, func, args, kwargs, weight, others, src, out) -> Product | None:
        name, axes = self.derived[id(weight)]
        if func in _LOOKUPS:
            if func is F.embedding:
                table, dim = (args[1] if len(args) > 1 else kwargs.get("weight")), 0
            else:
                table, dim = args[0], args[1]
            if table is not weight:
                return None
            kind, dims = "lookup", ((dim,), [i for i in range(len(axes)) if i != dim])
        elif func in _CONVS:
            kind, dims = "conv", ((), ())
        else:
            kind, dims = "matmul", _roles(func, args, weight)
            if dims is None:
                return None
        contracted, output = (tuple(axes[d] for d in side) for side in dims)
        if None in contracted + output:
            return None  # a reshaped weight: its axes are unknown
        result = tree_flatten(out)[0][0]
        return Product(
            index=len(self.flow.products),
            weight=name,
            kind=kind,
            contracted=contracted,
            output=output,
            inputs=src,
            in_numel=max(t.numel() for t in others),
            out_numel=result.numel() if isinstance(result, torch.Tensor) else 0,
        )


def _roles(func, args, weight) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(contracted dims, output-only dims) of ``weight`` in a product call."""
    if func is F.linear:
        return ((1,), (0,)) if args[1] is weight and weight.ndim == 2 else None
    if func in _MATMULS and weight.ndim >= 2:
        left, right = args[0], args[1]
        if func is torch.Tensor.__rmatmul__:
            left, right = right, left
        n = weight.ndim
        if right is weight:
            return (n - 2,), (n - 1,)
        if left is weight:
            return (n - 1,), (n - 2,)
        return None
    if func is torch.einsum:
        equation, *operands = args
        if len(operands) == 1 and isinstance(operands[0], list | tuple):
            operands = list(operands[0])
        return _einsum_roles(equation, operands, weight)
    return None


def _einsum_roles(equation: str, operands: list, weight) -> tuple | None:
    inputs, arrow, output = equation.replace(" ", "").partition("->")
    terms = inputs.split(",")
    if not arrow or len(terms) != len(operands):
        return None  # an implicit output: not Keras's
    # each ellipsis as the last letters of one spare run (broadcast right)
    widths = [
        t.ndim - len(term) + 3 if "..." in term else 0
        for term, t in zip(terms, operands, strict=True)
    ]
    fill = "".join(c for c in string.ascii_letters if c not in equation)[: max(widths)]
    terms = [
        term.replace("...", fill[len(fill) - width :])
        for term, width in zip(terms, widths, strict=True)
    ]
    output = output.replace("...", fill)
    position = next(i for i, t in enumerate(operands) if t is weight)
    mine = terms[position]
    elsewhere = set("".join(t for i, t in enumerate(terms) if i != position))
    contracted = tuple(
        i for i, c in enumerate(mine) if c in elsewhere and c not in output
    )
    only = tuple(i for i, c in enumerate(mine) if c in output and c not in elsewhere)
    return contracted, only
