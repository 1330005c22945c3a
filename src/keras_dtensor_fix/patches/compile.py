"""Let ``jit_compile=True`` run torch.compile under ModelParallel.

Upstream refuses it: its promotion mode makes dynamo skip every frame; with the mode off
(``promotion`` family) the step compiles. A model with repeated blocks compiles block by
block by default (:mod:`..compiled.plan`). The step runs eagerly, warned, where torch
cannot compile it (torch < 2.12, Keras's generic RNN loop, seeded random layers), and a
step that fails to compile before an optimizer update runs the batch again eagerly."""

from __future__ import annotations

import sys
import types
import warnings

import torch

from keras_dtensor_fix.checks import layout_rules
from keras_dtensor_fix.compiled import (
    blocks,
    cache_key,
    fallback,
    frames,
    plan,
    refusals,
    region,
)
from keras_dtensor_fix.engine import config, state, targets
from keras_dtensor_fix.engine.contract import Implementation, Patch
from keras_dtensor_fix.engine.state import model_parallel


def _use_torch_compile(wrapped, instance, args, kwargs):
    # With Keras's promotion mode on (the promotion family disabled) dynamo
    # would skip every frame: Keras's own answer stands.
    if model_parallel() is None or state.promotion_modes():
        return wrapped(*args, **kwargs)
    compiles = _compiles(instance)
    if _BUILDING:
        _BUILDING[-1][1] = compiles
    return compiles


def _compiles(instance) -> bool:
    """Whether ``instance``'s step compiles whole (blocks mode: installed, False)."""
    if not instance.jit_compile or instance.run_eagerly:
        plan.uninstall(instance)
        return False
    refused = refusals.step(instance)
    if refused is not None:
        warnings.warn(
            "keras-dtensor-fix: jit_compile=True is not used for this "
            f"ModelParallel model: {refused}",
            stacklevel=2,
        )
        return False
    building = _BUILDING[-1][0] if _BUILDING else None
    configured = config.compile_mode()
    mode, why = blocks.choose(instance, configured)
    if mode == "blocks" and configured == "auto" and building in _FORWARD:
        # Grad-free blocks run their own call: by default, evaluation and
        # prediction compile whole (a forward graph); the training step's
        # blocks stay installed (their region steps aside inside a graph).
        why = "the default: training goes block by block, this step has no backward"
        blocks.tell(instance, building, "step", why)
        return True
    training = building in (None, "make_train_function")
    found = plan.install(instance, training) if mode == "blocks" else None
    if found is not None:
        if training and found.split is not None:
            why += "; the layers after the last block and the loss: one region"
        if training and found.update:
            why += "; the optimizer's update: per block, one graph for alike blocks"
        blocks.tell(instance, building, "blocks", why)
        return False  # the step runs eagerly, its blocks compiled
    plan.uninstall(instance)
    blocks.tell(instance, building, "step", why)
    return True


#: The ``make_*_function`` running now (innermost last), and whether its step
#: compiles whole.
_BUILDING: list[list] = []
#: The trainer's step builders, the two without a backward last.
BUILDERS = ("make_train_function", "make_test_function", "make_predict_function")
_FORWARD = BUILDERS[1:]


def _check_layout_rules(model) -> None:
    """Every variable exists when a step is built: unmatched rules warn. Only
    once a sharded distribution was set (``train_on_batch`` builds each step)."""
    if state.SHARDING:
        layout_rules.warn_unmatched(model, model_parallel())


def _static_shapes(wrapped, instance, args, kwargs):
    """A ModelParallel step with ``jit_compile`` runs eagerly where torch.compile
    fails on it (:mod:`..compiled.fallback`). Compiled whole, it traces with static
    shapes (after a graph break "automatic dynamic" made the batch symbolic, which
    DTensor fails on: pytorch/pytorch#152963) under this process's cache key; in
    blocks mode each region does both itself."""
    _check_layout_rules(instance)
    _BUILDING.append([wrapped.__name__, False])
    try:
        result = wrapped(*args, **kwargs)
    finally:
        _, whole = _BUILDING.pop()
    attribute = wrapped.__name__[len("make_") :]
    step = getattr(instance, attribute, None)
    if (
        step is not None
        and model_parallel() is not None
        and instance.jit_compile
        and not getattr(step, "_keras_dtensor_fix_static", False)
    ):
        if whole:
            step = torch._dynamo.config.patch(automatic_dynamic_shapes=False)(step)
            step = cache_key.keyed(step, model_parallel())
            _losses_consumed(instance)
        step = fallback.eager_if_compile_fails(step, instance, wrapped.__name__)
        step._keras_dtensor_fix_static = True
        state.set_attribute(instance, attribute, step)
        frames.skip()
        _cache_backend_layouts(instance)
    return result


def _losses_consumed(instance) -> None:
    """A compiled step clears the ``add_loss`` losses once its loss read them (Keras
    clears them at the next call anyway): left in ``_losses`` (an MoE router's loss),
    dynamo made them a forward output whose ``grad_fn`` ``autograd.grad`` consumes (a
    failed trace over DTensors), and the next call compiled again."""
    compute_loss = instance._compute_loss
    if getattr(compute_loss, "_keras_dtensor_fix_clears", False):
        return

    def compute_and_clear(*args, **kwargs):
        loss = compute_loss(*args, **kwargs)
        if torch.compiler.is_compiling():
            instance._clear_losses()
        return loss

    compute_and_clear._keras_dtensor_fix_clears = True
    state.set_attribute(instance, "_compute_loss", compute_and_clear)


def _cache_backend_layouts(model) -> None:
    """Make each variable's backend layout now: made on the first assignment inside the
    traced step, it failed a guard at the next call (every model compiled twice)."""
    for variable in layout_rules.variables(model):
        layout = getattr(variable, "_layout", None)
        if layout is not None and hasattr(type(layout), "backend_layout"):
            layout.backend_layout  # noqa: B018  (a cached property)


def _eager_on_early_nightly(wrapped, instance, args, kwargs):
    """Early nightlies cannot compile a ModelParallel step (wrong DTensor tangents,
    ``with`` blocks dynamo cannot inline): built with ``jit_compile=False``."""
    _check_layout_rules(instance)
    if not (instance.jit_compile and model_parallel() is not None):
        return wrapped(*args, **kwargs)
    warnings.warn(
        "keras-dtensor-fix: this keras-nightly's trainer cannot compile a "
        "ModelParallel step; running without torch.compile. "
        f"keras-nightly>={FIRST_COMPILING_NIGHTLY} compiles it.",
        stacklevel=2,
    )
    return fallback.without_jit_compile(instance, lambda: wrapped(*args, **kwargs))


FIRST_COMPILING_NIGHTLY = "3.16.0.dev2026102704"


def patches(module: types.ModuleType) -> list[Patch]:
    if targets.is_kind(module.__name__, "layer_base"):
        # traced: a region's trace must run it (one frame per layer call, and
        # one guard, in a whole step's trace).
        scope, wrapper = "Layer._open_name_scope", region.name_scope
        return [Patch(module.__name__, scope, wrapper, gated=True, traced=True)]
    cls = targets.trainer_class(module)
    if not targets.trainer_compiles_model_parallel(module):
        return [
            Patch(module.__name__, f"{cls}.{name}", _eager_on_early_nightly)
            for name in BUILDERS
        ]
    return [
        Patch(module.__name__, f"{cls}._use_torch_compile", _use_torch_compile),
        Patch(module.__name__, f"{cls}.train_step", plan.step, gated=True),
    ] + [Patch(module.__name__, f"{cls}.{name}", _static_shapes) for name in BUILDERS]


def notes() -> list[str]:
    """Whether this nightly and torch compile a ModelParallel step; how the last one
    compiled and why."""
    module = sys.modules.get(targets.TRAINER)
    if module is None:
        return []
    if not targets.trainer_compiles_model_parallel(module):
        return [
            "jit_compile=True under ModelParallel runs eagerly on this "
            "keras-nightly (its trainer cannot compile the step); "
            f">={FIRST_COMPILING_NIGHTLY} compiles"
        ]
    if not targets.torch_compiles_dtensor_grad():
        return [
            "jit_compile=True under ModelParallel runs eagerly with torch "
            f"{torch.__version__} (dynamo cannot trace autograd.grad over "
            "DTensors); torch>=2.12 compiles"
        ]
    return list(blocks.LAST)


def after_revert() -> None:
    plan.forget()
    frames.restore()


IMPLEMENTATION = Implementation(patches, after_revert=after_revert, notes=notes)
