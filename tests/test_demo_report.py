"""The demo's comparison and verdict, on made-up launch reports (no processes)."""

from __future__ import annotations

import pytest

from keras_dtensor_fix import demo

LOSSES = [0.4, 0.07, 0.04, 0.035, 0.037][: demo.EPOCHS]


def run(ms: float, *, losses=LOSSES, compiled=False, **extra) -> dict:
    return {
        "losses": list(losses),
        "epoch_s": [1.0] * demo.EPOCHS,
        "ms_per_step": ms,
        "compiled": compiled,
        "jit_refused": "",
        "kernel": "DTensor (Replicate(), Shard(dim=1))",
        **extra,
    }


def reports(up: dict, eager: dict, jit: dict, *, modes=(), active=True) -> tuple:
    upstream = {
        "plugin_active": False,
        "jit_probe": "`jit_compile=True` is not supported with `ModelParallel`",
        "runs": {"eager": up},
    }
    plugin = {
        "plugin_active": active,
        "jit_probe": "",
        "dispatch_modes": list(modes),
        "runs": {"eager": eager, "jit": jit},
    }
    single = {"runs": {"eager": run(5.0)}}
    return upstream, plugin, single


def verdict(capsys: pytest.CaptureFixture[str], *args) -> tuple[int, str, str]:
    code = demo.report(*args, elapsed=60)
    out = capsys.readouterr().out
    return code, out, out.strip().splitlines()[-1]


def test_faster_than_upstream(capsys) -> None:
    code, out, last = verdict(
        capsys, *reports(run(60.0), run(10.0), run(12.0, compiled=True))
    )
    assert code == 0
    assert last == (
        "PASS: plugin eager 6.0x faster than upstream Keras (10.0 vs 60.0 ms/step); "
        "compiled 5.0x faster (12.0 ms/step); losses match one process to 0e+00"
    )
    assert "upstream with jit_compile=True: `jit_compile=True` is not supported" in out
    assert "dispatch modes active during training with the plugin: none" in out
    # The losses side by side, one column per run.
    assert "upstream" in out.split("\n\nepoch")[1].splitlines()[0]


def test_upstream_fails(capsys) -> None:
    up = {"error": "RuntimeError: aten.detach_.default does not have a sharding"}
    code, out, last = verdict(capsys, *reports(up, run(10.0), run(8.0, compiled=True)))
    assert code == 0
    assert "upstream Keras (plugin off), eager:   fails: RuntimeError" in out
    assert last.startswith(
        "PASS: upstream Keras fails (RuntimeError: aten.detach_.default does not "
        "have a sharding); plugin eager 10.0 ms/step; compiled 8.0 ms/step"
    )


def test_slower_and_eager_jit_are_reported_not_failed(capsys) -> None:
    jit = run(30.0, jit_refused="torch 2.11 cannot compile its gradient")
    code, out, last = verdict(capsys, *reports(run(20.0), run(25.0), jit))
    assert code == 0
    assert "plugin eager 1.2x slower than upstream Keras" in last
    assert "jit_compile=True (ran eagerly) 1.5x slower (30.0 ms/step)" in last
    assert "30.0 ms/step (not compiled: torch 2.11 cannot compile its gradient)" in out


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"eager": run(10.0, losses=[x * 1.01 for x in LOSSES])}, "differ from one"),
        ({"jit": {"error": "exit 1: Segmentation fault"}}, "did not finish"),
        ({"modes": ["KerasDTensorPromotionMode"]}, "a dispatch mode was active"),
        ({"active": False}, "the plugin was not active"),
    ],
)
def test_fail(capsys, change, problem) -> None:
    runs = {"eager": run(10.0), "jit": run(12.0, compiled=True)}
    runs.update({k: v for k, v in change.items() if k in runs})
    extra = {k: v for k, v in change.items() if k not in runs}
    code, _, last = verdict(
        capsys, *reports(run(60.0), runs["eager"], runs["jit"], **extra)
    )
    assert code == 1
    assert last.startswith("FAIL: ") and problem in last, last


def test_a_launch_that_dies_is_reported(tmp_path, capsys) -> None:
    """No report from the child: its exit status and last error line stand in."""
    out = tmp_path / "never.json"
    report = demo._launch("dies", out, ["eager", "bogus"], ranks=1, plugin=True)
    error = report["runs"]["eager"]["error"]
    assert error.startswith("exit 2: ") and "unknown runs ['bogus']" in error
    assert report["runs"]["bogus"] == report["runs"]["eager"]
    assert "done in" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--fast"], ["fast"]])
def test_unknown_arguments_are_refused(argv) -> None:
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
