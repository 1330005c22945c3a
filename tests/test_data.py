"""The ``data`` family's epoch iterator: one process's ``DataLoader`` under
ModelParallel, Keras's own iterator otherwise (the multi-process parity:
``tests/multiprocess/test_dropin.py``, case ``shuffled_dropout_fit``)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("torch")

from keras_dtensor_fix.patches import data  # noqa: E402


class _NoLoader:
    def get_torch_dataloader(self):
        raise NotImplementedError


class _Loader:
    """An adapter whose loader counts its ``iter()`` calls."""

    def __init__(self) -> None:
        self.iterated = 0

    def get_torch_dataloader(self):
        adapter = self

        class Loader:
            def __iter__(self):
                adapter.iterated += 1
                return iter(())

        return Loader()


def _original() -> str:
    return "keras's iterator"


def test_an_adapter_without_a_loader_keeps_kerass_iterator(monkeypatch) -> None:
    monkeypatch.setattr(data, "model_parallel", lambda: object())
    instance = types.SimpleNamespace(data_adapter=_NoLoader())
    assert data._one_process_batches(_original, instance, (), {}) == _original()


def test_without_model_parallel_kerass_iterator_runs(monkeypatch) -> None:
    monkeypatch.setattr(data, "model_parallel", lambda: None)
    adapter = _Loader()
    instance = types.SimpleNamespace(data_adapter=adapter)
    assert data._one_process_batches(_original, instance, (), {}) == _original()
    assert adapter.iterated == 0


def test_the_loader_is_iterated_at_once(monkeypatch) -> None:
    """Its ``iter()`` (which draws a seed from torch's generator) runs when
    Keras asks for the iterator, as one process's does, not at the first batch."""
    monkeypatch.setattr(data, "model_parallel", lambda: object())
    adapter = _Loader()
    instance = types.SimpleNamespace(data_adapter=adapter)
    batches = data._one_process_batches(_original, instance, (), {})
    assert adapter.iterated == 1
    assert list(batches) == []
