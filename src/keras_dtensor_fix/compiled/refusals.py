"""What a compiled ModelParallel step refuses up front (the step runs eagerly).

Layers torch 2.13 cannot compile over DTensors: Keras's generic RNN loop and
seeded random layers. The ``compile`` family asks before it builds a step.
Also whether a model trains with Keras's own ``train_step``, which blocks
mode's regions after the blocks rely on.
"""

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

    LSTM and GRU on their backend path (``use_cudnn`` "auto" or True, no
    recurrent dropout, GRU's ``reset_after``, no mask) compile, their sharded
    weights gathered once per call (the ``rnn`` family). The generic loop (any
    other RNN, those options, or a mask, which Keras's torch LSTM and GRU hand
    to the generic loop) does not compile under ModelParallel: torch 2.13 fails on
    the graph it leaves before its first graph break, after tracing for as
    long as a whole step takes to compile. A mask is seen where the model's
    graph shows it (functional and Sequential models); a subclassed model's
    masked LSTM still fails to compile and then runs eagerly.
    """
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
    """Whether the model's graph feeds ``layer`` a Keras mask (``Masking``,
    ``Embedding(mask_zero=True)`` before it)."""
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
