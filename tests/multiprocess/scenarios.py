"""Training scenarios run by the multi-process tests: the runner.

The cases live in ``cases_training.py`` (optimizers, data feeds, custom
loops), ``cases_layers.py`` (layers, compiled steps, the harness's case),
``cases_dropin.py`` (what runs on upstream too), ``cases_gan.py`` (the
guide's GANs, compiled), ``cases_hub.py``
(keras-hub models) and ``cases_layouts.py`` (keras-hub models on the
``layouts`` family's maps); what they share (the registry, data, models, layouts) in
``scenario_kit.py``. Run as ``torchrun --nproc_per_node=2 scenarios.py
GROUP[,GROUP...] OUT_DIR`` for the sharded run, or ``python scenarios.py
GROUP[,GROUP...] OUT_DIR`` for the single-process reference (the tests launch
the groups they compare together: ``conftest.BATCH``). Each process writes
``OUT_DIR/GROUP.rank<R>.json``: for every case, its losses, metrics,
predictions and final weights (full values), or the error
it raised. The same seed and data feed both runs; the single process runs
every case eagerly (``jit_compile`` off), the ground truth for compiled ranks,
but a case registered ``compiled_reference=True``: one process compiles it too
(where torch.compile's own numerics differ from eager beyond the tolerance).

A case that fails on some ranks only would leave the others waiting in a
collective until the process group's timeout (30 minutes): after each case
every rank reports to the others through the launcher's store, and a rank
whose peers do not report within ``SCENARIO_PEER_WAIT`` seconds (default 120)
says which case and exits, which makes torchrun stop them all.

Compiled cases run torch.compile's ``aot_eager`` backend (dynamo, AOT
autograd and the plugin's traced paths, no code generation) unless registered
with ``inductor=True``: the cases where inductor's code generation is the
point (the toy MLP, a keras-hub LLM (Gemma), QwenMoe, which the warm-cache
test launches again, and the (2, 2) MLP), or when
``SCENARIO_COMPILE_BACKEND`` names another backend for every case.

Environment: ``SCENARIO_CASES`` (comma list) limits the cases run;
``SCENARIO_SLOW=1`` runs the cases registered ``slow=True`` too (and, with
``KERAS_DTENSOR_FIX=0``, those registered ``upstream_slow=True``);
``SCENARIO_EXIT_PROMOTION=1`` exits Keras's promotion mode after
``set_distribution`` (to show what fails without the plugin);
``SCENARIO_NO_IMPLICIT_REPLICATION=1`` turns DTensor's implicit replication
off after it (to show what the plugin's switch fixes).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "torch")

import keras  # noqa: E402
import torch  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cases_blocks  # noqa: E402, F401  (each registers its cases)
import cases_collectives  # noqa: E402, F401
import cases_dropin  # noqa: E402, F401
import cases_fallback  # noqa: E402, F401
import cases_gan  # noqa: E402, F401
import cases_generate  # noqa: E402, F401
import cases_hub  # noqa: E402, F401
import cases_layers  # noqa: E402, F401
import cases_layouts  # noqa: E402, F401
import cases_planned  # noqa: E402, F401
import cases_training  # noqa: E402, F401
from scenario_kit import CASES, RANK, SEED, WORLD, distribute  # noqa: E402

PEER_WAIT = float(os.environ.get("SCENARIO_PEER_WAIT", "120"))


# ---------------------------------------------------------------- runner


@contextlib.contextmanager
def compile_backend(backend: str):
    """``torch.compile`` (Keras's trainer calls it bare) defaults to ``backend``."""
    original = torch.compile

    def compile_with(*args, **kwargs):
        kwargs.setdefault("backend", backend)
        return original(*args, **kwargs)

    torch.compile = compile_with
    try:
        yield
    finally:
        torch.compile = original


@contextlib.contextmanager
def eager_reference():
    """Every ``compile()`` in one process builds eager steps (``jit_compile``
    off): the one-process reference is the eager run, which a compiled
    sharded run must equal; one process compiling it again would only add
    its own compile time (and its own graph breaks) to the suite."""
    model = keras.Model
    original = model.compile

    def compile_eagerly(self, *args, **kwargs):
        kwargs["jit_compile"] = False
        return original(self, *args, **kwargs)

    model.compile = compile_eagerly
    try:
        yield
    finally:
        del model.compile  # Model inherits compile() from its trainer


def run_case(name: str) -> dict:
    spec = CASES[name]
    # Each case starts as a fresh script would: the trainer's step code is
    # shared by every model, and dynamo stops compiling a code object after
    # its recompile limit.
    torch._dynamo.reset()
    # DTensor's sharding cache hands out output specs by value: a mesh equal
    # to an earlier case's would come back as that case's object, and dynamo
    # guards on a mesh's identity.
    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in ("propagate_op_sharding", "_propagate_tensor_meta_cached"):
        getattr(getattr(propagator, cached, None), "cache_clear", lambda: None)()
    # reset() keeps dynamo's counters (graph breaks, cache hits): each case
    # counts its own, whichever cases ran before it in the process.
    torch._dynamo.utils.counters.clear()
    keras.utils.set_random_seed(SEED)
    distribute(spec["mesh"], spec.get("layout"))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    backend = os.environ.get("SCENARIO_COMPILE_BACKEND") or (
        "inductor" if spec.get("inductor") else "aot_eager"
    )
    started = time.perf_counter()
    try:
        eager = WORLD == 1 and not spec.get("compiled_reference")
        reference = eager_reference() if eager else contextlib.nullcontext()
        with compile_backend(backend), reference:
            result = spec["fn"]()
        result["seconds"] = round(time.perf_counter() - started, 2)
        # How many dynamo graphs the case compiled (0: it ran eagerly).
        result["dynamo_graphs"] = (
            torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs
        )
        promotion = [
            type(m).__name__
            for m in torch.utils._python_dispatch._get_current_dispatch_mode_stack()
        ]
        result["dispatch_modes"] = promotion
        return result
    except Exception as err:  # reported, compared by the tests
        return {
            "error": f"{type(err).__name__}: {err}",
            "traceback": traceback.format_exc(),
            "seconds": round(time.perf_counter() - started, 2),
        }
    finally:
        keras.distribution.set_distribution(None)


def wait_for_peers(name: str, result: dict) -> None:
    """Every rank finished ``name``, or this process ends the run naming it."""
    store = torch.distributed.distributed_c10d._get_default_store()
    store.set(f"scenario/{name}/{RANK}", "error" if "error" in result else "ok")
    keys = [f"scenario/{name}/{rank}" for rank in range(WORLD)]
    try:
        store.wait(keys, datetime.timedelta(seconds=PEER_WAIT))
    except Exception:  # the store's timeout error differs by torch release
        missing = [key for key in keys if not store.check([key])]
        print(
            f"scenario {name!r}: rank {RANK} finished it "
            f"({'failed' if 'error' in result else 'ok'}) but {missing} did not "
            f"within {PEER_WAIT:.0f} s: they wait in a collective this rank "
            f"skipped. This rank's result:\n{result.get('traceback', result)}",
            file=sys.stderr,
            flush=True,
        )
        os._exit(3)


def main(argv: list[str]) -> int:
    groups, out_dir = argv[0].split(","), argv[1]
    keras.config.disable_traceback_filtering()
    if WORLD > 1:
        keras.distribution.initialize()
    only = [c for c in os.environ.get("SCENARIO_CASES", "").split(",") if c]
    slow = os.environ.get("SCENARIO_SLOW") == "1"
    names = [
        n
        for g in groups
        for n, spec in CASES.items()
        if spec["group"] == g and (slow or not spec.get("slow"))
    ]
    if only:
        names = [n for n in names if n in only]
    if os.environ.get("KERAS_DTENSOR_FIX") == "0" and not slow:
        names = [n for n in names if not CASES[n].get("upstream_slow")]
    results = {}
    for name in names:
        results[name] = run_case(name)
        if WORLD > 1:
            wait_for_peers(name, results[name])
    os.makedirs(out_dir, exist_ok=True)
    for one in groups:
        mine = {n: r for n, r in results.items() if CASES[n]["group"] == one}
        with open(os.path.join(out_dir, f"{one}.rank{RANK}.json"), "w") as handle:
            json.dump({"world": WORLD, "cases": mine}, handle)
    if WORLD > 1:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from support import leave  # skips a teardown that can abort: see leave()

    leave(main(sys.argv[1:]))
