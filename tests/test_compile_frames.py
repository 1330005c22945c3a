"""DTensor's subclass methods, never compiled as frames (``compiled/frames.py``).

A custom ``train_step``'s ``backward()`` is a graph break, run with dynamo's
frame hook on: each Python frame the backward enters is compiled on its own.
Here a backward that calls ``DTensor.__tensor_unflatten__`` (as torch's
runtime of a compiled graph does for each DTensor gradient) runs from a
compiled function, on a one-rank mesh: without ``frames.skip`` dynamo
compiles the helper once per shape (the guide's GANs hit its recompile
limit, ``tests/multiprocess/test_dropin.py::test_compiled_gan_stays_compiled``);
with it, none; ``frames.restore`` gives dynamo's default back.
"""

from __future__ import annotations

import torch
from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.distributed.tensor import DTensor, Replicate

from keras_dtensor_fix.compiled import frames


def _helper_frames_after_backward(mesh) -> int:
    spec = DTensor.from_local(torch.ones(2), mesh, [Replicate()]).__tensor_flatten__()

    class Rebuild(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            inner = {"_local_tensor": grad, "device_mesh": mesh}
            DTensor.__tensor_unflatten__(inner, spec[1], grad.shape, grad.stride())
            return grad

    # The engine's call of backward is not a frame dynamo compiles (as AOT
    # autograd's runtime is not): what it calls is.
    torch._dynamo.eval_frame.skip_code(Rebuild.backward.__code__)

    @torch.compile(backend="eager")
    def step(t):
        loss = (Rebuild.apply(t) * 2).sum()
        loss.backward()  # a graph break, run with dynamo's frame hook on
        return loss

    for n in (2, 3):
        step(torch.ones(n, requires_grad=True))
    code = DTensor.__tensor_unflatten__.__code__
    return len(_debug_get_cache_entry_list(code))


def test_helpers_are_not_frames_until_restored(mesh1) -> None:
    frames.restore()
    try:
        torch._dynamo.reset()
        assert _helper_frames_after_backward(mesh1) == 2  # once per shape
        torch._dynamo.reset()  # which clears a compiled code's strategy too
        frames.skip()
        assert _helper_frames_after_backward(mesh1) == 0
        frames.restore()
        torch._dynamo.reset()
        assert _helper_frames_after_backward(mesh1) == 2
    finally:
        frames.restore()
        torch._dynamo.reset()
