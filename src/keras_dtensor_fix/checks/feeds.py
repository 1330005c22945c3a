"""Every process feeds an epoch the same batches, or all of them raise.

Under ModelParallel each step is collective: a process that runs out of
batches while another still has one leaves that one waiting in the step's
first collective until the group's timeout (30 minutes on gloo), with no
message; batches of different sizes make a global batch that no process
holds (upstream runs it, silently wrong). Both exchanges
(:func:`before_epoch`, :func:`per_batch`) are one all-gather of the same
length, so a process starting a new pass over its data meets another's batch
and both raise. Pure torch.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from torch.utils._pytree import tree_leaves

from keras_dtensor_fix.dtensor import all_gather_ints
from keras_dtensor_fix.dtensor import world as place

#: The first integer of each exchange: which one it is.
EPOCH, BATCH = 1, 2
#: A count or size this process does not know.
UNKNOWN = -1

WHAT_TO_DO = (
    "What to do: feed every process the same number of batches of one size: "
    "give each the same number of rows, a multiple of batch_size (drop the "
    "remainder, e.g. x[: len(x) // batch_size * batch_size]), or repeat the "
    "data and pass steps_per_epoch (and validation_steps) no larger than the "
    "smallest process's count."
)


class UnevenDataError(RuntimeError):
    """Processes under ModelParallel feed different batches to one epoch."""

    def __init__(self, message: str, rows: list[list[int]]) -> None:
        super().__init__(message)
        #: Each process's exchange, indexed by rank.
        self.rows = rows


def epoch_row(adapter: Any, steps_per_epoch: int | None) -> list[int]:
    """What this process feeds the epoch, from its Keras data adapter."""

    def read(name: str) -> Any:
        try:
            return getattr(adapter, name)
        except (AttributeError, NotImplementedError, TypeError):
            return None

    size = read("batch_size")
    partial = read("has_partial_batch")
    last = read("partial_batch_size") if partial else size
    if partial is None:
        last = None
    values = (read("num_batches"), size, last, steps_per_epoch)
    return [EPOCH, *(UNKNOWN if v is None else int(v) for v in values)]


def _describe(row: list[int]) -> str:
    kind, first, second, third, fourth = row
    if kind == BATCH:
        if not first:
            return f"no batch left after {third} batches"
        return f"batch {third + 1} of {second} rows"
    count = "an unknown number of" if first == UNKNOWN else str(first)
    size = "unknown size" if second == UNKNOWN else f"{second} rows"
    text = f"{count} batches of {size}"
    if third not in (UNKNOWN, second):
        text += f", the last of {third}"
    if fourth != UNKNOWN:
        text += f", steps_per_epoch={fourth}"
    return text


def _raise(rows: list[list[int]], why: str) -> None:
    lines = "\n".join(f"  process {r}: {_describe(row)}" for r, row in enumerate(rows))
    raise UnevenDataError(
        "keras-dtensor-fix: under ModelParallel every process must feed each "
        f"epoch the same number of batches of one size; {why}, which would "
        f"hang the step (or train on a global batch no process holds):\n{lines}\n"
        + WHAT_TO_DO,
        rows,
    )


def _exchange(row: list[int]) -> list[list[int]]:
    rows = all_gather_ints(row)
    if len({r[0] for r in rows}) > 1:
        _raise(
            rows,
            "one process began a new pass over its data (its epoch "
            "ended) while another had a batch",
        )
    return rows


def _differ(values: list[int]) -> bool:
    return UNKNOWN not in values and len(set(values)) > 1


def before_epoch(adapter: Any, steps_per_epoch: int | None) -> bool | None:
    """Agree on what every process feeds this epoch (``fit``, validation,
    ``evaluate``, ``predict``); raise :class:`UnevenDataError` where it differs.

    Returns None with one process (nothing to agree on), else whether the
    batches must be agreed on one by one (:func:`per_batch`): where a count or
    a size is unknown (a generator, a ``PyDataset``, an iterable loader), or
    the counts differ under ``steps_per_epoch``.
    """
    if place.world() == 1:
        return None
    rows = _exchange(epoch_row(adapter, steps_per_epoch))
    _, counts, sizes, lasts, steps = (list(c) for c in zip(*rows, strict=True))
    if len(set(steps)) > 1:
        _raise(rows, "steps_per_epoch differs")
    if _differ(sizes):
        _raise(rows, "the batch size differs")
    if _differ(lasts):
        _raise(rows, "the last batch's size differs")
    if _differ(counts) and steps[0] == UNKNOWN:
        _raise(rows, "the number of batches differs")
    return UNKNOWN in counts + sizes + lasts or len(set(counts)) > 1


def _rows_of(batch: Any) -> int:
    for leaf in tree_leaves(batch):
        local = leaf.to_local() if hasattr(leaf, "to_local") else leaf
        if (shape := getattr(local, "shape", None)) is not None and len(shape):
            return int(shape[0])
    return UNKNOWN


def per_batch(batches: Iterator[Any]) -> Iterator[Any]:
    """``batches``, each first agreed on by every process: all have one of the
    same size, or all have none (the epoch ends), else all raise."""
    for index, batch in enumerate(itertools.chain(batches, [_END])):
        have = batch is not _END
        rows = _exchange([BATCH, int(have), _rows_of(batch) if have else 0, index, 0])
        if not any(row[1] for row in rows):
            return
        if not all(row[1] for row in rows):
            _raise(rows, "one process ran out of batches while another had one")
        if len({row[2] for row in rows}) > 1:
            _raise(rows, "the batch size differs")
        yield batch


_END = object()
