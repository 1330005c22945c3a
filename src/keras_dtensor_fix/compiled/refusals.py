"""What a compiled ModelParallel step refuses up front (it then runs eagerly), and
whether
a model trains with Keras's own ``train_step``."""

from __future__ import annotations

import importlib

from keras_dtensor_fix.engine import targets


def keras_train_step(model) -> bool:
    """Whether ``model``'s class trains with the torch trainer's ``train_step``."""
    module = importlib.import_module(targets.TRAINER)
    trainer = getattr(module, targets.trainer_class(module))
    return getattr(type(model), "train_step", None) is trainer.train_step


def recurrent_layers(model) -> list[str]:
    """Recurrent layers of ``model`` that run Keras's generic RNN loop.

    LSTM and GRU on their backend path (``use_cudnn`` "auto" or True, no recurrent
    dropout, ``reset_after``, no mask) compile; the generic loop fails under
    ModelParallel (torch 2.13) after tracing as long as a whole step."""
    rnn = targets.keras_object("RNN")
    fast = (targets.keras_object("LSTM"), targets.keras_object("GRU"))
    found = []
    for layer in model._flatten_layers(include_self=False):
        if not isinstance(layer, rnn):
            continue
        if (
            isinstance(layer, fast)
            and getattr(layer, "use_cudnn", None) in ("auto", True)
            and not getattr(layer, "recurrent_dropout", 0)
            and getattr(layer, "reset_after", True)
            and not _receives_mask(layer)
        ):
            continue
        found.append(layer.name)
    return found


def _receives_mask(layer) -> bool:
    """Whether the model's graph feeds ``layer`` a Keras mask."""
    for node in getattr(layer, "_inbound_nodes", None) or ():
        for tensor in getattr(node, "input_tensors", None) or ():
            if getattr(tensor, "_keras_mask", None) is not None:
                return True
    return False


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
