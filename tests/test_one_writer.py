"""``one_writer.write_atomically`` and the restarts family's store, in one process.

The multi-process behaviour (one writer per path, errors on every process,
killed writers, restarts) is in ``tests/multiprocess/test_saving.py``; here,
what a writer leaves on disk: the new file whole, or the earlier file
untouched, and never a staging directory.
"""

from __future__ import annotations

import os

import pytest

from keras_dtensor_fix.saving import one_writer


def entries(directory) -> list[str]:
    return sorted(os.listdir(directory))


def test_replaces_the_file_whole(tmp_path) -> None:
    target = tmp_path / "w.weights.h5"
    target.write_text("old")

    def write(path: str) -> None:
        assert os.path.dirname(path) != str(tmp_path)  # staged beside, not in place
        assert target.read_text() == "old"  # a reader still sees the old file
        with open(path, "w") as handle:
            handle.write("new")

    one_writer.write_atomically(str(target), write)
    assert target.read_text() == "new"
    assert entries(tmp_path) == ["w.weights.h5"]


def test_a_failed_write_leaves_the_earlier_file(tmp_path) -> None:
    target = tmp_path / "w.weights.h5"
    target.write_text("old")

    def write(path: str) -> None:
        with open(path, "w") as handle:
            handle.write("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        one_writer.write_atomically(str(target), write)
    assert target.read_text() == "old"
    assert entries(tmp_path) == ["w.weights.h5"]


def test_several_files_move_in_the_named_one_last(tmp_path) -> None:
    """A sharded save: shards, then its index (a reader of the index finds them)."""
    moved = []
    real_replace = os.replace

    def write(path: str) -> None:
        folder = os.path.dirname(path)
        for name in ("m_00000.weights.h5", "m_00001.weights.h5"):
            with open(os.path.join(folder, name), "w") as handle:
                handle.write(name)
        with open(path, "w") as handle:
            handle.write("index")

    def replace(source: str, target: str) -> None:
        moved.append(os.path.basename(target))
        real_replace(source, target)

    os.replace = replace
    try:
        one_writer.write_atomically(str(tmp_path / "m.weights.json"), write)
    finally:
        os.replace = real_replace
    assert moved[-1] == "m.weights.json"
    assert entries(tmp_path) == [
        "m.weights.json",
        "m_00000.weights.h5",
        "m_00001.weights.h5",
    ]


def test_a_missing_directory_is_the_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        one_writer.write_atomically(str(tmp_path / "no" / "w.weights.h5"), print)


def test_save_timeout_from_the_environment(monkeypatch) -> None:
    from keras_dtensor_fix.engine import config

    monkeypatch.setenv(config.ENV_SAVE_TIMEOUT, "12.5")
    assert config.save_seconds() == 12.5
    monkeypatch.setenv(config.ENV_SAVE_TIMEOUT, "soon")
    with pytest.warns(UserWarning, match="not a positive number"):
        assert config.save_seconds() == config.DEFAULT_SAVE_SECONDS


def test_attempt_prefix_only_under_torchrun(monkeypatch) -> None:
    from keras_dtensor_fix.patches import restarts

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert restarts.attempt_prefix() is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert restarts.attempt_prefix() is None
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert restarts.attempt_prefix() == "keras_dtensor_fix/attempt_1"
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")  # two agents: counts differ
    assert restarts.attempt_prefix() is None
    # The round from the agent's wrapper is the same on every agent.
    monkeypatch.setenv(restarts.ROUND, "3")
    assert restarts.attempt_prefix() == "keras_dtensor_fix/round_3"
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    assert restarts.attempt_prefix() is None


def test_several_agents_without_a_round_say_so(monkeypatch) -> None:
    """Several agents whose torchrun runs without the plugin: nothing names
    the attempt, and the process says what to do."""
    import torch.distributed as dist

    from keras_dtensor_fix.patches import restarts

    store = dist.HashStore()
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    monkeypatch.delenv(restarts.ROUND, raising=False)
    with pytest.warns(UserWarning, match="keras-dtensor-fix where torchrun runs"):
        assert restarts._create_store(lambda: store, None, (), {}) is store
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")  # one agent: its count names it
    prefixed = restarts._create_store(lambda: store, None, (), {})
    assert isinstance(prefixed, dist.PrefixStore)


def test_agent_hands_its_workers_the_rendezvous_round(monkeypatch) -> None:
    """The agent's wrapper reads the round from torch's dynamic rendezvous
    and sets it only while the workers start."""
    from types import SimpleNamespace as NS

    from keras_dtensor_fix.patches import restarts

    monkeypatch.delenv(restarts.ROUND, raising=False)
    state = NS(round=4)
    group = NS(spec=NS(rdzv_handler=NS(_state_holder=NS(state=state))))
    seen = []

    def start(worker_group):
        seen.append(os.environ.get(restarts.ROUND))

    restarts._start_workers(start, None, (group,), {})
    assert seen == ["4"] and restarts.ROUND not in os.environ
    restarts._start_workers(start, None, (NS(spec=NS(rdzv_handler=None)),), {})
    assert seen == ["4", None]  # a static rendezvous has no round


def test_a_writer_keeps_gathered_values_in_host_memory(mesh1, monkeypatch) -> None:
    """Each gathered variable goes to host memory at once (on a GPU the writer
    would otherwise hold the whole model on the device until the file is
    written). Here the "device" tensor is a stand-in that records the move."""
    import torch
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from keras_dtensor_fix.saving import one_writer

    moved = []

    class OnDevice:
        def __init__(self, value):
            self.value = value

        def cpu(self):
            moved.append(self.value)
            return self.value

    full_tensor = DTensor.full_tensor
    monkeypatch.setattr(
        DTensor, "full_tensor", lambda self: OnDevice(full_tensor(self))
    )
    values = [
        distribute_tensor(torch.ones(4, 2) * i, mesh1, [Shard(0)]) for i in (1, 2)
    ]
    cache = one_writer._gather(values, keep=True)
    assert len(moved) == 2
    assert all(isinstance(v, torch.Tensor) for v in cache.values()), cache
    assert one_writer._gather(values, keep=False) == {}


def _two_processes(monkeypatch, run):
    """``run(rank)`` on two threads that the store exchange takes for processes."""
    import threading

    import torch.distributed as dist

    from keras_dtensor_fix.dtensor import world
    from keras_dtensor_fix.saving import handshake

    store, local = dist.HashStore(), threading.local()

    class Counts:  # each "process" counts its own calls
        def __getitem__(self, key):
            return vars(local).setdefault("counts", {}).get(key, 0)

        def __setitem__(self, key, value):
            vars(local).setdefault("counts", {})[key] = value

    monkeypatch.setattr(world, "world", lambda: 2)
    monkeypatch.setattr(world, "rank", lambda: local.rank)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(handshake, "_counts", Counts())
    found: dict[int, object] = {}

    def one(rank: int) -> None:
        local.rank = rank
        try:
            found[rank] = run(rank)
        except Exception as exc:  # noqa: BLE001 - what the test checks
            found[rank] = exc

    threads = [threading.Thread(target=one, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    return found


def test_the_first_acts_and_every_process_learns(monkeypatch) -> None:
    """One protocol (``handshake.one_acts``): the first process's result or
    failure reaches every process, through the store."""
    from keras_dtensor_fix.checkpoint.files import CheckpointError
    from keras_dtensor_fix.checkpoint.processes import on_first

    acted = []

    def name(rank_seen: int) -> str:
        acted.append(rank_seen)
        return "ckpt-7"

    found = _two_processes(monkeypatch, lambda rank: on_first(name, rank))
    assert found == {0: "ckpt-7", 1: "ckpt-7"} and acted == [0]

    def broken() -> None:
        raise FileNotFoundError("no such directory: /gone")

    found = _two_processes(monkeypatch, lambda rank: on_first(broken))
    assert isinstance(found[0], FileNotFoundError)  # its own error
    assert isinstance(found[1], CheckpointError)
    assert "process 0: FileNotFoundError: no such directory: /gone" in str(found[1])


def test_one_writer_per_path_and_a_failure_everywhere(monkeypatch, tmp_path) -> None:
    from keras_dtensor_fix.saving import one_writer

    path = str(tmp_path / "same.txt")

    def write(rank: int) -> None:
        def run() -> None:
            if rank == 0:
                raise OSError("disk full")

        one_writer.by_one("save test", path, run)

    found = _two_processes(monkeypatch, write)
    for rank in (0, 1):
        assert isinstance(found[rank], one_writer.SaveError), found[rank]
        assert f"process 0 writing {path}: OSError: disk full" in str(found[rank])
