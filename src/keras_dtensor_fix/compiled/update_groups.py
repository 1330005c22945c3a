"""Blocks mode's optimizer update compiled per block, one graph for alike blocks.

Eager ``_foreach_*`` updates are one op per variable, which a whole step's graph
fuses, but tracing the whole ``apply`` made the start grow with the depth
(``benchmarks/results/2026-11-29-update-per-block.md``). So ``apply`` runs eagerly on
DTensors and the instance's ``_parallel_update_step`` runs the shard-wise update
(:mod:`..ops.shardwise`) per owning block (:class:`Grouped`), each group through a
region keyed by its shapes on stand-ins (slot lists cut to the group, variables whose
``value`` it sets): one graph serves alike blocks.

Only Keras's own ``train_step`` and torch optimizers whose update is per variable (not
Nadam) and selects no branch (gradient accumulation, EMA overwrites)."""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Any

from keras_dtensor_fix.compiled import refusals, region
from keras_dtensor_fix.engine import state, targets
from keras_dtensor_fix.ops import shardwise

__all__ = ["Grouped", "groupable", "install", "uninstall"]


def install(model: Any, routed: list[Any]) -> str | None:
    """Give ``model``'s optimizer its update per block; None, or why not."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not callable(getattr(optimizer, "apply", None)):
        return "it has no optimizer"
    if not refusals.keras_train_step(model):
        return "its class has a train_step() of its own"
    reason = groupable(optimizer)
    if reason is not None or _installed(optimizer):
        return reason
    update = functools.partial(_update, Grouped(optimizer, list(routed)), optimizer)
    state.set_attribute(optimizer, "_parallel_update_step", update)
    return None


def uninstall(model: Any) -> None:
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and _installed(optimizer):
        del vars(optimizer)["_parallel_update_step"]


def _installed(optimizer: Any) -> bool:
    update = vars(optimizer).get("_parallel_update_step")
    return getattr(update, "func", None) is _update


def _update(grouped: Grouped, optimizer: Any, grads, variables, learning_rate) -> Any:
    """The optimizer's ``_parallel_update_step``: per group when eager on DTensors under
    ModelParallel, else the class's."""
    grads, variables = list(grads), list(variables)
    if (
        state.compiling()
        or state.model_parallel() is None
        or not shardwise.sharded(grads, variables)
    ):
        cls_update = type(optimizer)._parallel_update_step
        return cls_update(optimizer, grads, variables, learning_rate)
    step = functools.partial(grouped.update, optimizer)
    runner = functools.partial(grouped, step, optimizer)
    return shardwise.update(
        optimizer, step, grads, variables, learning_rate, runner=runner
    )


def groupable(optimizer: Any) -> str | None:
    """Why ``optimizer``'s update cannot run per group, or None."""
    update = _update_function(optimizer)
    if update is None or not targets.per_variable_update(update):
        return f"{type(optimizer).__name__}'s update is not per variable"
    if shardwise.selects_branches(optimizer):
        return "its update selects branches"
    return None


def _update_function(optimizer: Any) -> Any:
    update = getattr(type(optimizer), "_parallel_update_step", None)
    return getattr(update, "__wrapped__", update)  # the family's wrapper


class _Entry:
    """One group shape: its stand-ins and region."""

    def __init__(self, optimizer: Any, rows: list[str], size: int, name: str) -> None:
        # Stand-in Keras variables: the updates read only their ``value``.
        self.stands = [SimpleNamespace(value=None) for _ in range(size)]
        self.rows = [[SimpleNamespace(value=None) for _ in self.stands] for _ in rows]
        self.proxy = object.__new__(type(optimizer))
        self.overrides = {
            "_trainable_variables": list(self.stands),
            "_trainable_variables_indices": {
                id(stand): index for index, stand in enumerate(self.stands)
            },
            **{row: list(stands) for row, stands in zip(rows, self.rows, strict=True)},
        }
        self.sync(optimizer)
        self.region = region.Region(
            _group_step,
            f"the update of {type(optimizer).__name__}",
            qualname=name,
            interleaved=True,
        )

    def sync(self, optimizer: Any) -> None:
        """The real optimizer's attributes now (hyperparameters, step count)."""
        attributes = vars(self.proxy)
        attributes.update(vars(optimizer))
        attributes.update(self.overrides)


def _group_step(update, proxy, stands, rows, grads, values, slots, learning_rate):
    """The region: the stand-ins take the group's tensors, then the class's update runs
    on them."""
    for row, row_values in zip([stands, *rows], [values, *slots], strict=True):
        for stand, value in zip(row, row_values, strict=True):
            stand.value = value
    update(proxy, grads, stands, learning_rate)


class Grouped:
    """The shard-wise update of one optimizer, group by group."""

    def __init__(self, optimizer: Any, routed: list[Any]) -> None:
        #: The class's own update (:func:`groupable` checked it per variable).
        self.update = _update_function(optimizer)
        self._name = f"{type(optimizer).__qualname__}.update"
        self._owner = {
            id(variable): index
            for index, block in enumerate(routed)
            for variable in block.trainable_variables
        }
        self._entries: dict[tuple, _Entry] = {}
        #: Whether a compile failed: every update runs eagerly from then on.
        self.failed = False

    def __call__(
        self, bound: Any, optimizer: Any, grads: list, variables: list, lr: Any
    ) -> None:
        """Run ``bound`` (the class's update) on local ``grads`` and ``variables``, per
        group."""
        rows = _slot_rows(optimizer, variables)
        if self.failed or rows is None:
            bound(grads, variables, lr)
            return
        for done, indices in enumerate(self._groups(variables)):
            try:
                self._run(bound, optimizer, rows, indices, grads, variables, lr)
            except Exception as error:
                if not done:
                    raise
                # Not from torch's runner (whose failures the compile family
                # retries eagerly): a retry would update the first groups twice.
                raise RuntimeError(
                    f"keras-dtensor-fix: {self._name} failed after updating "
                    f"{done} of its groups of variables ({type(error).__name__}: "
                    f"{error}); the step cannot run again. Compile with "
                    "jit_compile=False to train as upstream Keras does."
                ) from error

    def _run(self, bound, optimizer, rows, indices, grads, variables, lr) -> None:
        group_vars = [variables[i] for i in indices]
        group_grads = [grads[i] for i in indices]
        if self.failed:
            bound(group_grads, group_vars, lr)
            return
        values = [v.value for v in group_vars]
        slots = [[row[i].value for i in indices] for row in rows.values()]
        # Alike blocks share an entry (Steady checks each tensor's metadata).
        key = (tuple(rows), tuple((v.shape, v.dtype) for v in values))
        if key not in self._entries:
            self._entries[key] = _Entry(optimizer, list(rows), len(indices), self._name)
        entry = self._entries[key]
        entry.sync(optimizer)
        fixed = (self.update, entry.proxy, entry.stands, entry.rows)
        tensors = (group_grads, values, slots, lr)
        entry.region(lambda: bound(group_grads, group_vars, lr), *fixed, *tensors)
        self.failed = entry.region.failed

    def _groups(self, variables: list) -> list[list[int]]:
        """Indices of ``variables`` by owning block, in order; the rest last."""
        by_owner: dict[int, list[int]] = {}
        for index, variable in enumerate(variables):
            by_owner.setdefault(self._owner.get(id(variable), -1), []).append(index)
        rest = by_owner.pop(-1, [])
        return [*by_owner.values(), *([rest] if rest else [])]


def _slot_rows(optimizer: Any, variables: list) -> dict[str, list[Any]] | None:
    """The optimizer's slot lists (one variable per trainable one), cut to
    ``variables``' order; None where a variable is not the optimizer's or another list
    of that length holds anything else."""
    indices = getattr(optimizer, "_trainable_variables_indices", None)
    trainable = getattr(optimizer, "_trainable_variables", None)
    if not isinstance(indices, dict) or not isinstance(trainable, list):
        return None
    try:
        positions = [indices[optimizer._var_key(v)] for v in variables]
    except KeyError:
        return None
    own = {id(v) for v in trainable}
    rows = {}
    for name, value in vars(optimizer).items():
        if name == "_trainable_variables" or not isinstance(value, list):
            continue
        if len(value) != len(trainable) or not value:
            continue
        if not all(hasattr(item, "_value") and id(item) not in own for item in value):
            return None
        rows[name] = [value[p] for p in positions]
    return rows
