"""Restarts under ``torchrun --max-restarts``: each attempt its own store keys.

torchrun's agent hands one TCPStore to every attempt, and torch gives the
default group keys with no attempt in them: after a restart gloo can read a
dead attempt's address and fail or wait (pytorch/pytorch#135712 for NCCL).
Every ``env://`` and ``tcp://`` start makes its store in
``_create_c10d_store``; there the agent's store gets a prefix naming the
attempt: the rendezvous round the agent (where the plugin starts too) hands
its workers (:data:`ROUND`), else ``TORCHELASTIC_RESTART_COUNT`` under one
agent. Several agents without a round count apart: the store is left as is
and each process warns (:data:`UNSHARED_ROUND`).
"""

from __future__ import annotations

import os
import types
import warnings

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require

#: The rendezvous round an agent started its workers in, set by its wrapper.
ROUND = "KERAS_DTENSOR_FIX_RDZV_ROUND"


def attempt_prefix() -> str | None:
    """This attempt's key prefix under torchrun's agent store; else ``None``."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    round_ = os.environ.get(ROUND)
    if round_ is not None:
        return f"keras_dtensor_fix/round_{round_}"
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    return f"keras_dtensor_fix/attempt_{attempt}"


UNSHARED_ROUND = (
    "keras-dtensor-fix: under several torchrun agents a restart reconnects only "
    "when the plugin starts in torchrun's own process too (pip install "
    "keras-dtensor-fix where torchrun runs): it did not here, so a restarted "
    "attempt may fail to connect or wait, as without the plugin."
)


def _create_store(wrapped, instance, args, kwargs):
    store = wrapped(*args, **kwargs)
    prefix = attempt_prefix()
    if prefix is not None:
        import torch.distributed as dist

        return dist.PrefixStore(prefix, store)
    if (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and os.environ.get("GROUP_WORLD_SIZE", "1") != "1"
    ):  # several agents, no round from theirs: nothing names the attempt
        warnings.warn(UNSHARED_ROUND, stacklevel=3)
    return store


def _start_workers(wrapped, instance, args, kwargs):
    group = args[0] if args else kwargs.get("worker_group")
    # The rendezvous round that made the group: torch's private state.
    handler = getattr(getattr(group, "spec", None), "rdzv_handler", None)
    state = getattr(getattr(handler, "_state_holder", None), "state", None)
    round_ = getattr(state, "round", None)
    if not isinstance(round_, int):
        return wrapped(*args, **kwargs)
    # The workers inherit the agent's environment while they start.
    saved = os.environ.get(ROUND)
    os.environ[ROUND] = str(round_)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if saved is None:
            os.environ.pop(ROUND, None)
        else:
            os.environ[ROUND] = saved


def patches(module: types.ModuleType) -> list[Patch]:
    name = module.__name__
    moved = "this torch moved it"
    if targets.is_kind(name, "elastic_agent"):
        start = require(module, "LocalElasticAgent._start_workers", moved)
        return [Patch(name, start, _start_workers)]
    create = require(module, "_create_c10d_store", moved)
    return [Patch(name, create, _create_store)]


IMPLEMENTATION = Implementation(patches)
