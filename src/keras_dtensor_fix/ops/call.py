"""One call of a wrapped op, as the op-handler table's rows see it.

:class:`Op` is what a row knows about the op (decided once, when its wrapper
is made); :class:`Call` is one call on the slow path, shared by the rows that
run on it; :data:`NOT_HANDLED` is a row's "not mine". Standard library only.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NOT_HANDLED", "Call", "Op", "Unbound"]


@dataclass(frozen=True)
class Op:
    """What the handlers know about the op they handle."""

    name: str
    elementwise: bool  # operands broadcast elementwise (per-rank shards refused)
    contraction: bool  # a product over an axis: a Partial result is reduced
    signature: inspect.Signature | None  # binds a call's arguments by name
    #: ``signature``'s parameters as plain data: (name, kind, has a default)
    parameters: tuple[tuple[str, Any, bool], ...] | None = field(
        init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        params = None
        if self.signature is not None:
            params = tuple(
                (p.name, p.kind, p.default is not p.empty)
                for p in self.signature.parameters.values()
            )
        object.__setattr__(self, "parameters", params)


_P = inspect.Parameter
_POSITIONAL = (_P.POSITIONAL_ONLY, _P.POSITIONAL_OR_KEYWORD)
_VAR_POSITIONAL, _VAR_KEYWORD = _P.VAR_POSITIONAL, _P.VAR_KEYWORD


def bind(parameters: tuple, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``Signature.bind(*args, **kwargs).arguments`` on plain data.

    inspect's own reads the signature's mapping proxy, which dynamo refuses
    to read after a dict was written in the same trace: a graph break at
    each op call (torch 2.13; Qwen3.5's convolutions). Raises ``TypeError``
    where the call does not fit.
    """
    arguments: dict[str, Any] = {}
    rest = list(args)
    for name, kind, _ in parameters:
        if kind in _POSITIONAL and rest:
            arguments[name] = rest.pop(0)
        elif kind is _VAR_POSITIONAL and rest:
            arguments[name], rest = tuple(rest), []
    if rest:
        raise TypeError("too many positional arguments")
    extra = dict(kwargs)
    var_keyword = None
    for name, kind, has_default in parameters:
        if kind is _VAR_KEYWORD:
            var_keyword = name
        elif kind not in (_VAR_POSITIONAL, _P.POSITIONAL_ONLY) and name in extra:
            if name in arguments:
                raise TypeError(f"multiple values for argument {name!r}")
            arguments[name] = extra.pop(name)
        elif kind is not _VAR_POSITIONAL and name not in arguments and not has_default:
            raise TypeError(f"missing a required argument: {name!r}")
    if extra:
        if var_keyword is None:
            raise TypeError(f"unexpected keyword arguments {sorted(extra)}")
        arguments[var_keyword] = extra
    return arguments


def call_form(parameters: tuple, arguments: dict) -> tuple[tuple, dict]:
    """``BoundArguments.args`` and ``.kwargs`` of bound ``arguments``."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    positional = True
    for name, kind, _ in parameters:
        if positional and kind in (*_POSITIONAL, _VAR_POSITIONAL) and name in arguments:
            if kind is _VAR_POSITIONAL:
                args.extend(arguments[name])
            else:
                args.append(arguments[name])
            continue
        positional = False
        if name not in arguments:
            continue
        if kind is _VAR_KEYWORD:
            kwargs.update(arguments[name])
        elif kind is not _VAR_POSITIONAL:
            kwargs[name] = arguments[name]
    return tuple(args), kwargs


#: A handler's "not mine": the next handler runs.
NOT_HANDLED = object()


class Unbound(Exception):
    """The call does not fit the op's signature: the op itself says why."""


class Call:
    """One call of a wrapped op on the slow path, shared by its handlers.

    :attr:`arguments` binds the call to the op's signature at first use, once
    (handlers that need no names never pay for it). A handler that writes an
    argument there rewrites the call for the handlers after it; :meth:`run`
    calls the original with the call as it stands.
    """

    __slots__ = ("op", "wrapped", "_args", "_kwargs", "_bound")

    def __init__(
        self, op: Op, wrapped: Callable[..., Any], args: tuple, kwargs: dict
    ) -> None:
        self.op, self.wrapped = op, wrapped
        self._args, self._kwargs = args, kwargs
        self._bound: dict[str, Any] | None = None

    @property
    def arguments(self) -> dict[str, Any]:
        """The arguments by parameter name (defaults not filled in); writable."""
        if self._bound is None:
            if self.op.parameters is None:
                raise Unbound(self.op.name)
            try:
                self._bound = bind(self.op.parameters, self._args, self._kwargs)
            except TypeError as exc:
                raise Unbound(self.op.name) from exc
        return self._bound

    @property
    def args(self) -> tuple:
        if self._bound is None:
            return self._args
        return call_form(self.op.parameters, self._bound)[0]

    @property
    def kwargs(self) -> dict:
        if self._bound is None:
            return self._kwargs
        return call_form(self.op.parameters, self._bound)[1]

    def run(self, **changes: Any) -> Any:
        """The original on this call, with ``changes`` to its arguments if any.

        ``changes`` leave the call itself as it was.
        """
        if not changes:
            return self.wrapped(*self.args, **self.kwargs)
        args, kwargs = call_form(self.op.parameters, {**self.arguments, **changes})
        return self.wrapped(*args, **kwargs)
