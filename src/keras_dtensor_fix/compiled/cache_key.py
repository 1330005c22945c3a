"""The compile caches' key tag: which process a compiled graph belongs to.

AOT autograd keys its on-disk cache on dynamo's graph, which is the same on
every process, but the graph it compiles from a DTensor program holds this
process's own shard offsets and process group names. The caches are shared by
the processes of a machine and by every launch, so without the process in the
key one process runs a graph compiled for another (a (2, 2) mesh: "Could not
resolve the process group registered under the name 3"). Every function the
plugin compiles (the step, a block, generation's token step) is keyed here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def cache_key_tag(dist: Any, user_tag: str = "") -> str:
    """This process's tag under ``dist``, the user's own ``user_tag`` in front."""
    from keras_dtensor_fix.dtensor import world as place

    mesh = dist.device_mesh
    rank, world = place.rank(), place.world()
    groups = ""
    backend_mesh = getattr(mesh, "backend_mesh", None)
    if backend_mesh is not None and world > 1:
        names = [backend_mesh.get_group(i).group_name for i in range(backend_mesh.ndim)]
        groups = ",".join(names)
    ours = (
        f"keras_dtensor_fix:rank={rank}/{world}"
        f":mesh={tuple(mesh.shape)}:groups={groups}"
    )
    return f"{user_tag}|{ours}" if user_tag else ours


def keyed(function: Callable[..., Any], dist: Any) -> Callable[..., Any]:
    """``function`` run with this process's tag set around each call (as it
    is without a distribution: its graphs hold nothing of one process)."""
    import torch

    if dist is None:
        return function

    tag = cache_key_tag(dist, torch.compiler.config.cache_key_tag)
    return torch.compiler.config.patch(cache_key_tag=tag)(function)
