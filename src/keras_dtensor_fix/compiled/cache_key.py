"""The compile caches' key tag: which process a compiled graph belongs to.

AOT autograd keys its on-disk cache on dynamo's graph, the same on every process, but
the compiled graph holds this process's shard offsets and group names: without the
process in the key, one process ran another's graph ("Could not resolve the process
group registered under the name 3")."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def keyed(function: Callable[..., Any], dist: Any) -> Callable[..., Any]:
    """``function`` run with this process's tag under ``dist`` set around each call (the
    user's own tag in front)."""
    import torch

    from keras_dtensor_fix.dtensor import world as place

    if dist is None:
        return function
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
    user_tag = torch.compiler.config.cache_key_tag
    tag = f"{user_tag}|{ours}" if user_tag else ours
    return torch.compiler.config.patch(cache_key_tag=tag)(function)
