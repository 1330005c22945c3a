"""A compiled step whose graph fails while it runs, after its first batch.

``compiled/fallback.eager_if_compile_fails`` reruns a batch eagerly when the failure
comes from inside torch's runner of a compiled graph (a custom step's
``backward()``: the guide's GAN met "Expected a DTensor tangent but got a
plain Tensor" after a few batches) and no optimizer of the model counted a
step in that batch (``fallback.marks``); after one it raises, naming
``jit_compile=False``, since the rerun would apply that update twice. Here the
"graph" is a function compiled with a file name inside AOT autograd's
runtime, so the test needs no sharded compile.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import pytest
import torch

from keras_dtensor_fix.compiled import fallback

RUNTIME = "/site/torch/_functorch/_aot_autograd/runtime_wrappers.py"


def _in_runtime(message: str) -> None:
    code = compile(f"raise RuntimeError({message!r})", RUNTIME, "exec")
    exec(code)


class Model:
    """What the fallback reads of a Keras model: its optimizers and builder."""

    def __init__(self) -> None:
        self.optimizer = SimpleNamespace(
            iterations=SimpleNamespace(value=torch.zeros(()))
        )
        self._jit_compile = True
        self.train_function = None

    def make_train_function(self, force: bool = False) -> None:
        assert not self._jit_compile, "the eager step is built with jit_compile off"
        self.train_function = lambda batch: ("eager", batch)


def _compiled(model: Model, *, update_first: bool):
    calls = []

    def train_function(batch):
        calls.append(batch)
        if len(calls) == 1:
            return ("compiled", batch)
        if update_first:
            model.optimizer.iterations.value += 1
        _in_runtime("\nExpected a DTensor tangent but got a plain Tensor")

    train_function.__name__ = "train_function"
    return fallback.eager_if_compile_fails(train_function, model, "make_train_function")


def test_a_later_batch_reruns_eagerly_where_nothing_was_applied() -> None:
    model = Model()
    step = _compiled(model, update_first=False)
    assert step(1) == ("compiled", 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert step(2) == ("eager", 2)
    (warning,) = [w for w in caught if "runs eagerly" in str(w.message)]
    assert "Expected a DTensor tangent" in str(warning.message)
    assert model._jit_compile is True  # only that build was eager


def test_a_later_batch_after_an_update_raises_naming_the_switch() -> None:
    model = Model()
    step = _compiled(model, update_first=True)
    step(1)
    with pytest.raises(RuntimeError, match="jit_compile=False") as raised:
        step(2)
    assert "Expected a DTensor tangent" in str(raised.value.__cause__)


def test_marks_see_every_optimizer_and_copy_the_count() -> None:
    counter = torch.zeros(())
    model = SimpleNamespace(
        d_optimizer=SimpleNamespace(iterations=SimpleNamespace(value=counter)),
        g_optimizer=SimpleNamespace(iterations=SimpleNamespace(value=torch.ones(()))),
        other=3,
    )
    taken = fallback.marks(model)
    assert len(taken) == 2
    assert fallback.none_since(taken)
    counter += 1
    assert not fallback.none_since(taken)
