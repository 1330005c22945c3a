"""Restarts under ``torchrun --max-restarts``: each attempt its own store keys.

torchrun's agent keeps one TCPStore for the whole job and hands it to every
attempt (``TORCHELASTIC_USE_AGENT_STORE``). torch's rendezvous assumes a new
store per attempt ("no need to add prefix for each attempt") and gives the
default process group keys with no attempt in them: after a restart, gloo can
read the address a process of the dead attempt published and fail ("Gloo
connectFullMesh failed ... Connection refused") or wait for it. It happens
however the group is started, since every ``env://`` and ``tcp://`` start
(``init_process_group`` with or without arguments, Keras's ``initialize``,
``init_device_mesh``) makes its store in ``_create_c10d_store``: there, the
agent's store gets the prefix ``keras_dtensor_fix/attempt_<N>``
(``TORCHELASTIC_RESTART_COUNT``). Outside torchrun, and with several
torchrun agents (whose restart counts can differ), the store is untouched.
"""

from __future__ import annotations

import os
import types

from keras_dtensor_fix.contract import Implementation, Patch


def attempt_prefix() -> str | None:
    """This attempt's key prefix under torchrun's agent store; else ``None``."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    # With several agents the count is each agent's own: one that restarts
    # for a peer's new rendezvous round, not a failure of its own, keeps its
    # count, so the agents' processes would disagree on the prefix.
    if os.environ.get("GROUP_WORLD_SIZE", "1") != "1":
        return None
    return f"keras_dtensor_fix/attempt_{attempt}"


def _create_store(wrapped, instance, args, kwargs):
    store = wrapped(*args, **kwargs)
    prefix = attempt_prefix()
    if prefix is None:
        return store
    import torch.distributed as dist

    return dist.PrefixStore(prefix, store)


def patches(module: types.ModuleType) -> list[Patch]:
    if not callable(getattr(module, "_create_c10d_store", None)):
        raise LookupError("_create_c10d_store")
    return [Patch(module.__name__, "_create_c10d_store", _create_store)]


IMPLEMENTATION = Implementation(patches)
