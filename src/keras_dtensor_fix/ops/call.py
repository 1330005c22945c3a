"""One call of a wrapped op as the table's rows see it: :class:`Op` (decided once per
wrapper), :class:`Call` (one slow-path call) and :data:`NOT_HANDLED` (a row's "not
mine"). Standard library only."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["NOT_HANDLED", "Call", "Op", "Unbound"]


@dataclass(frozen=True)
class Op:
    """What the handlers know about the op they handle."""

    name: str
    elementwise: bool  # operands broadcast elementwise (per-rank shards refused)
    contraction: bool  # a product over an axis: a Partial result is reduced
    signature: inspect.Signature | None  # binds a call's arguments by name


#: A handler's "not mine": the next handler runs.
NOT_HANDLED = object()


class Unbound(Exception):
    """The call does not fit the op's signature: the op itself says why."""


class Call:
    """One call on the slow path, shared by its handlers: :attr:`arguments` binds it
    once, at first use; a handler writing an argument rewrites the call for the rows
    after it."""

    __slots__ = ("op", "wrapped", "_args", "_kwargs", "_bound")

    def __init__(
        self, op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict
    ) -> None:
        self.op, self.wrapped = op, wrapped
        self._args, self._kwargs = args, kwargs
        self._bound: inspect.BoundArguments | None = None

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments by parameter name (defaults not filled in); writable."""
        if self._bound is None:
            if self.op.signature is None:
                raise Unbound(self.op.name)
            try:
                self._bound = self.op.signature.bind(*self._args, **self._kwargs)
            except TypeError as exc:
                raise Unbound(self.op.name) from exc
        return self._bound.arguments

    @property
    def args(self) -> tuple:
        return self._args if self._bound is None else self._bound.args

    @property
    def kwargs(self) -> dict:
        return self._kwargs if self._bound is None else self._bound.kwargs

    def run(self, **changes: Any) -> Any:
        """The original on this call, with ``changes`` (the call itself unchanged)."""
        if not changes:
            return self.wrapped(*self.args, **self.kwargs)
        bound = inspect.BoundArguments(self.op.signature, {**self.arguments, **changes})
        return self.wrapped(*bound.args, **bound.kwargs)
