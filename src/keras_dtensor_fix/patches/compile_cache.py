"""Warm compile caches: a second launch reads the first one's graphs back.

Two keys that torch 2.13 cannot make the same from launch to launch:

- keras-hub's Gemma scales its queries by ``1 / np.sqrt(head_dim)`` inside the
  step; dynamo traces the numpy call (``numpy_to_tensor_wrapper``, which AOT
  autograd's cache accepts by its numpy name) and the division by it
  (``numpy_operator_wrapper(operator.truediv)``, which it does not:
  "Unsupported call_function target <Wrapped operator <original
  wrapped_truediv>>"). So every launch bypassed the cache and compiled again,
  on one process too. An operator wrapper does nothing but apply a function of
  the ``operator`` module, so it is keyed by that function's name here, as
  torch keys the numpy wrappers (seen with torch 2.13; upstream:
  https://github.com/pytorch/pytorch/issues/156943, a fix proposed in
  https://github.com/pytorch/pytorch/pull/184074).
- A graph that takes a ``DeviceMesh`` as an input (QwenMoe's step) keys it by
  pickling the mesh itself, with the pickler's memo switched on for the rest
  of the key (the mesh's references may be cyclic), which makes the key depend
  on which of its objects happen to be the same Python object: AOT autograd's
  and inductor's keys differed at every launch, so every launch missed. A
  mesh is keyed here by what a graph compiled for it depends on: its device
  type, shape, ranks, dimension names and process group names (torch 2.13;
  the same memo effect on ``torch.device`` keys:
  https://github.com/pytorch/pytorch/pull/128366).
"""

from __future__ import annotations

import operator
import sys
import types

from keras_dtensor_fix.engine import targets
from keras_dtensor_fix.engine.contract import Implementation, Patch


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
    if module.__name__ in targets.modules("inductor_codecache"):
        pickler = getattr(module, "FxGraphCachePickler", None)
        if not callable(getattr(pickler, "_reduce_fake_script_object", None)):
            raise LookupError(PICKLER)
        return [Patch(module.__name__, PICKLER, _reduce_fake_script_object)]
    if not callable(getattr(module, "numpy_wrapper_cache_key", None)):
        raise LookupError("numpy_wrapper_cache_key")
    return [
        Patch(
            module.__name__,
            "numpy_wrapper_cache_key",
            _cache_key,
            also_in=targets.aliases("dynamo_utils"),
        )
    ]


IMPLEMENTATION = Implementation(patches)
