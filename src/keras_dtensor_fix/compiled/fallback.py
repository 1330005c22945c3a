"""A compiled step that torch.compile fails on runs again eagerly, where it may.

Upstream trains every ModelParallel model eagerly, so a compile failure rebuilds the
step without torch.compile (warned) and runs the batch again. A failure inside
torch's runner of a compiled graph (pytorch/pytorch#143134) reruns only where no
optimizer counted a step in it (:func:`marks`), its random draws and metric updates
put back first (:func:`kept`, :func:`rewind`). The first calls' graph breaks and
recompilations are reported once each (:func:`break_report`).
"""

from __future__ import annotations

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from keras_dtensor_fix.compiled import failure
from keras_dtensor_fix.ops.first_call import first_line

Marks = list[tuple[Any, torch.Tensor]]
#: model -> its seed generators' states (found once: a step adds none).
_SEEDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def marks(model: Any) -> Marks:
    """Each optimizer the model holds (any attribute with ``iterations``) with a copy of
    its step count, kept on the device."""
    found = {}
    for value in vars(model).values():
        try:
            counter = getattr(getattr(value, "iterations", None), "value", None)
        except Exception:  # noqa: BLE001 - a property that raises holds no count
            continue
        if isinstance(counter, torch.Tensor):
            found[id(counter)] = (counter, _local(counter).detach().clone())
    return list(found.values())


def none_since(taken: Marks) -> bool:
    """Whether no optimizer has counted a step since ``taken``."""
    return all(torch.equal(_local(counter), before) for counter, before in taken)


def _local(value: Any) -> torch.Tensor:
    """A tensor's (or a Keras variable's) local part."""
    value = getattr(value, "value", value)
    return getattr(value, "_local_tensor", value)


def kept(model: Any) -> Marks:
    """Copies of what a step changes besides weights and optimizers: seed generator
    states and metric variables."""
    try:
        seeds = _SEEDS.get(model)
        if seeds is None:
            seeds = [v for v in model.variables if "seed_generator" in v.path]
            _SEEDS[model] = seeds
        variables = seeds + list(model.metrics_variables)
        return [(v, _local(v).detach().clone()) for v in variables]
    except Exception:  # noqa: BLE001 - a model without them keeps nothing
        return []


def rewind(taken: Marks) -> None:
    """Put back what :func:`kept` copied."""
    with torch.no_grad():
        for variable, before in taken:
            _local(variable).copy_(before)


def eager_if_compile_fails(
    function: Callable[..., Any], instance: Any, make: str
) -> Callable[..., Any]:
    """``function`` (the step ``make`` built), or the eager step once torch.compile
    fails on it; a failure after an optimizer counted a step raises, naming
    ``jit_compile=False``."""
    ran = []
    told: set[str] = set()

    @functools.wraps(function)
    def step(*args, **kwargs):
        watch = len(ran) < WATCHED_CALLS
        before = dynamo_counts() if watch else None
        taken, state = marks(instance), kept(instance)
        try:
            result = function(*args, **kwargs)
        except Exception as error:
            graph_failed = failure.in_compiled_runtime(error)
            if graph_failed and ran and not none_since(taken):
                raise RuntimeError(
                    "keras-dtensor-fix: a compiled ModelParallel step failed "
                    "inside torch's compiled graph after an optimizer applied "
                    f"its update ({type(error).__name__}); it cannot run again "
                    "eagerly. Compile with jit_compile=False to run it as "
                    "upstream Keras does."
                ) from error
            if not (failure.compile_failure(error) or graph_failed):
                raise
            warnings.warn(
                "keras-dtensor-fix: torch.compile failed on this ModelParallel "
                f"step ({first_line(error)}); it runs eagerly from "
                "now on, as upstream Keras runs it.",
                stacklevel=2,
            )
            without_jit_compile(instance, lambda: getattr(instance, make)(force=True))
            rewind(state)
            return getattr(instance, make[len("make_") :])(*args, **kwargs)
        if watch:
            message = break_report(before, dynamo_counts(), len(ran))
            if message is not None and message[:60] not in told:
                told.add(message[:60])
                warnings.warn(message, stacklevel=2)
        ran.append(True)
        return result

    return step


#: The first calls of a compiled step, whose graph breaks and recompilations
#: are reported (once each); later calls pay nothing for it.
WATCHED_CALLS = 3


def dynamo_counts() -> tuple[dict[str, int], int]:
    """dynamo's graph breaks by reason, and its count of graphs compiled."""
    counters = torch._dynamo.utils.counters
    return dict(counters["graph_break"]), counters["stats"]["unique_graphs"]


def break_report(
    before: tuple[dict[str, int], int], after: tuple[dict[str, int], int], call: int
) -> str | None:
    """What a user should hear about call ``call`` (from 0) of a compiled step."""
    (breaks, graphs), (breaks_now, graphs_now) = before, after
    new = {
        reason: count - breaks.get(reason, 0)
        for reason, count in breaks_now.items()
        if count > breaks.get(reason, 0)
    }
    parts = []
    if new:
        reasons = "; ".join(reason.splitlines()[0][:160] for reason in list(new)[:3])
        parts.append(f"has {sum(new.values())} graph break(s) ({reasons})")
    if call > 0 and graphs_now > graphs:
        parts.append(f"compiled again on call {call + 1} (new shapes or guards)")
    if not parts:
        return None
    return (
        "keras-dtensor-fix: this compiled ModelParallel step "
        + " and ".join(parts)
        + ". Each costs time, and DTensor gradients across a graph break have "
        "come out wrong with torch 2.13: compare with jit_compile=False. "
        "TORCH_LOGS=graph_breaks,recompiles shows where."
    )


def without_jit_compile(instance: Any, build: Callable[[], Any]) -> Any:
    """``build()`` (a step builder) with ``instance``'s ``jit_compile`` off."""
    jit_compile = instance._jit_compile
    instance._jit_compile = False
    try:
        return build()
    finally:
        instance._jit_compile = jit_compile
