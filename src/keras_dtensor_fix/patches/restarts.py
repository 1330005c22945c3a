"""``keras.distribution.initialize()`` under ``torchrun --max-restarts``.

torchrun's agent keeps one TCPStore for the whole job and hands it to every
attempt (``TORCHELASTIC_USE_AGENT_STORE``), but the process group's keys in
it carry no attempt number: after a restart, gloo can read the address a
process of the dead attempt published and fail to connect ("Gloo
connectFullMesh failed ... Connection refused"), upstream Keras and plain
``init_process_group`` alike, in some runs. Keras's ``initialize`` then
gives the group a store whose keys start with the attempt
(``TORCHELASTIC_RESTART_COUNT``).
"""

from __future__ import annotations

import os
import types
from datetime import timedelta

from keras_dtensor_fix.engine import Implementation, Patch

#: torch's default process group timeout.
TIMEOUT = timedelta(minutes=30)


def attempt_store():
    """The agent's store, its keys under this attempt's prefix; else ``None``."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist

    store = dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=TIMEOUT,
    )
    return dist.PrefixStore(f"keras_dtensor_fix/attempt_{attempt}/default_pg", store)


def _initialize(wrapped, instance, args, kwargs):
    import torch.distributed as dist

    if dist.is_initialized():
        return wrapped(*args, **kwargs)
    store = attempt_store()
    if store is None:
        return wrapped(*args, **kwargs)
    init_process_group = dist.init_process_group

    def with_store(*a, **k):
        if k.get("store") is None and k.get("init_method") is None:
            k["store"] = store
        return init_process_group(*a, **k)

    dist.init_process_group = with_store  # only while Keras's initialize runs
    try:
        return wrapped(*args, **kwargs)
    finally:
        dist.init_process_group = init_process_group


def patches(module: types.ModuleType) -> list[Patch]:
    if not hasattr(module, "initialize"):
        raise LookupError("initialize")
    return [Patch(module.__name__, "initialize", _initialize)]


IMPLEMENTATION = Implementation(patches)
