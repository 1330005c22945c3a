"""What inductor's CPU instruction-set probe costs each new process.

Inductor's C++ backend picks the CPU's vector instruction set once per
process (``torch._inductor.cpu_vec_isa.pick_vec_isa``: ``CppCodeCache.load``
keys each C++ kernel by it, so loading a warm cache's kernels pays it too).
For each candidate
it compiles a test program (once: the build is cached in the inductor cache
directory) and then loads it in a new Python subprocess, which links
libtorch_cpu; nothing of that outcome is kept across processes. Pure torch,
one process; run it twice on one ``TORCHINDUCTOR_CACHE_DIR`` (the second run
is a warm process), and with ``TORCHINDUCTOR_VEC_ISA_OK=1`` (no probe):

    python benchmarks/repro/vec_isa_probe.py
"""

from __future__ import annotations

import os
import time

import torch  # noqa: F401  (imported before the clock starts)
from torch._inductor import cpu_vec_isa


def main() -> None:
    start = time.perf_counter()
    picked = cpu_vec_isa.pick_vec_isa()
    seconds = time.perf_counter() - start
    again = time.perf_counter()
    cpu_vec_isa.pick_vec_isa()
    cached = time.perf_counter() - again
    setting = os.environ.get("TORCHINDUCTOR_VEC_ISA_OK", "unset")
    print(
        f"TORCHINDUCTOR_VEC_ISA_OK={setting}: picked {picked!s} in {seconds:.2f} s "
        f"(again in this process: {cached * 1000:.1f} ms)"
    )


if __name__ == "__main__":
    main()
