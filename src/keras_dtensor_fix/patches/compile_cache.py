"""Warm compile caches: a second launch reads the first one's graphs back.

Two keys torch 2.13 did not make the same from launch to launch:

- ``numpy_operator_wrapper(operator.truediv)`` (Gemma's ``1 / np.sqrt``): AOT autograd's
  cache refused it. It is keyed by the ``operator`` function's name, as torch keys the
  numpy wrappers (pytorch/pytorch#156943).
- A ``DeviceMesh`` graph input (QwenMoe), pickled with the memo on. It is keyed by what
  a graph depends on: device type, shape, ranks, names and group names.
"""

from __future__ import annotations

import operator
import sys
import types

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch, require


def operator_key(obj: object) -> tuple[str, str] | None:
    """A cache key for a ``numpy_operator_wrapper`` of an ``operator`` function."""
    cls = type(obj)
    utils = sys.modules.get("torch._dynamo.utils")
    if cls is not getattr(utils, "numpy_operator_wrapper", None):
        return None
    op = getattr(obj, "op", None)
    name = getattr(op, "__name__", "")
    if not name or getattr(operator, name, None) is not op:
        return None
    return (cls.__qualname__, f"operator.{name}")


def _cache_key(wrapped, instance, args, kwargs):
    key = wrapped(*args, **kwargs)
    if key is None and args:
        key = operator_key(args[0])
    return key


def mesh_key(obj: object) -> tuple | None:
    """What a graph compiled for the ``DeviceMesh`` ``obj`` depends on, or None."""
    device_mesh = sys.modules.get("torch.distributed.device_mesh")
    mesh_class = getattr(device_mesh, "DeviceMesh", None)
    if mesh_class is None or not isinstance(obj, mesh_class):
        return None
    groups: tuple[str, ...] = ()
    if obj.mesh.numel() > 1:
        groups = tuple(obj.get_group(i).group_name for i in range(obj.ndim))
    return (
        obj.device_type,
        tuple(obj.mesh.shape),
        obj.mesh.flatten().tolist(),
        obj.mesh_dim_names,
        groups,
    )


def _reduce_fake_script_object(wrapped, instance, args, kwargs):
    fake = args[0] if args else kwargs.get("t")
    key = mesh_key(getattr(fake, "real_obj", None))
    # torch's identity reducer, from the module of the method it stands in for
    # (a subclass's module, AOT autograd's, need not have it).
    ident = getattr(sys.modules.get(wrapped.__module__), "_ident", None)
    if key is None or ident is None:
        return wrapped(*args, **kwargs)
    return ident, (fake.script_class_name, key)


PICKLER = "FxGraphCachePickler._reduce_fake_script_object"


def patches(module: types.ModuleType) -> list[Patch]:
    name, moved = module.__name__, "this torch moved it"
    if name in targets.MODULES["inductor_codecache"]:
        pickler = require(module, PICKLER, moved)
        return [Patch(name, pickler, _reduce_fake_script_object)]
    key = require(module, "numpy_wrapper_cache_key", moved)
    return [Patch(name, key, _cache_key, targets.ALIASES["dynamo_utils"])]


IMPLEMENTATION = Implementation(patches)
