"""What a compiled ModelParallel step refuses up front (it then runs eagerly), and
whether a model trains with Keras's own ``train_step``."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import Any

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.ops.values import output_laid_out


def keras_train_step(model) -> bool:
    """Whether ``model``'s class trains with the torch trainer's ``train_step``."""
    module = importlib.import_module(targets.TRAINER)
    trainer = getattr(module, targets.trainer_class(module))
    return getattr(type(model), "train_step", None) is trainer.train_step


def step(model: Any) -> str | None:
    """Why ``model``'s compiled ModelParallel step runs eagerly, or None."""
    if not targets.torch_compiles_dtensor_grad():
        import torch  # the version the check read: the torch imported

        return (
            f"torch {torch.__version__} cannot compile its gradient (before "
            "torch 2.12 dynamo cannot trace torch.autograd.grad over DTensors). The "
            "model runs eagerly. Install torch>=2.12 to compile it."
        )
    if recurrent := recurrent_layers(model):
        return (
            f"its recurrent layers ({', '.join(recurrent)}) run Keras's generic RNN "
            f"loop, which torch {targets.torch_version()} cannot compile over "
            "DTensors. The model runs eagerly. LSTM and GRU with their defaults "
            "(use_cudnn='auto', no recurrent_dropout) and no mask compile."
        )
    if seeded := seeded_random_layers(model):
        return (
            f"its seeded random layers ({', '.join(seeded)}) draw with a "
            "torch.Generator, a graph break, and with torch 2.13 DTensor gradients "
            "across a graph break are wrong. The model runs eagerly. To compile "
            "it, give those layers seed=None."
        )
    return None


def recurrent_layers(model) -> list[str]:
    """Recurrent layers of ``model`` that run Keras's generic RNN loop (not LSTM and GRU
    on their backend path), which fails under ModelParallel (torch 2.13) after tracing
    as long as a whole step."""
    rnn = targets.keras_object("RNN")
    fast = (targets.keras_object("LSTM"), targets.keras_object("GRU"))
    found = []
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, rnn) and not (
            isinstance(layer, fast)
            and getattr(layer, "use_cudnn", None) in ("auto", True)
            and not getattr(layer, "recurrent_dropout", 0)
            and getattr(layer, "reset_after", True)
            and not _receives_mask(layer)
        ):
            found.append(layer.name)
    return found


def _receives_mask(layer) -> bool:
    """Whether the model's graph feeds ``layer`` a Keras mask."""
    return any(
        getattr(tensor, "_keras_mask", None) is not None
        for node in getattr(layer, "_inbound_nodes", None) or ()
        for tensor in getattr(node, "input_tensors", None) or ()
    )


def seeded_random_layers(model) -> list[str]:
    """Layers whose seeded generator makes a graph break (Dropout(seed=...))."""
    seed_generator = targets.keras_object("SeedGenerator")
    found = []
    for layer in model._flatten_layers(include_self=False):
        for value in vars(layer).values():
            if isinstance(value, seed_generator) and value._initial_seed is not None:
                if getattr(layer, "rate", 1.0) not in (0, 0.0):
                    found.append(layer.name)
                break
    return found


def layers(found: Iterable[Any]) -> str | None:
    """Why a region cannot hold these layers, or None: an output layout (a path,
    which a region's guards would tell apart) or an activity regularizer."""
    distribution = targets.keras_object("distribution")()
    if distribution is not None and distribution.get_tensor_layout("/output"):
        return "the LayoutMap lays out the path '/output'"
    for layer in found:
        if output_laid_out(layer):
            return f"the LayoutMap lays out {layer.path}/output"
        if getattr(layer, "activity_regularizer", None) is not None:
            return f"{layer.name} has an activity regularizer"
    return None
