"""What the installed plugin adds to every Python start (the ``.pth`` hook).

Runs ``python -c pass`` (and ``python -c "import keras"``) in one virtual
environment with ``keras_dtensor_fix.pth`` in its site-packages and with it
renamed away, interleaved round by round, and prints the medians and the
median of the paired differences. Usage::

    python benchmarks/boot.py [--python .venv/bin/python] [--rounds 30]

The environment needs the plugin installed (``pip install .`` or ``-e .``);
the script restores the ``.pth`` file on exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PTH = "keras_dtensor_fix.pth"


def site_packages(python: str) -> Path:
    out = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def once(python: str, code: str, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run([python, "-c", code], env=env, check=True)
    return (time.perf_counter() - start) * 1000


def measure(python: str, code: str, rounds: int, pth: Path) -> dict[str, float]:
    env = {**os.environ, "KERAS_BACKEND": "torch"}
    off = pth.with_suffix(".pth.off")
    on_ms, off_ms, diffs = [], [], []
    for _ in range(rounds):
        a = once(python, code, env)
        pth.rename(off)
        try:
            b = once(python, code, env)
        finally:
            off.rename(pth)
        on_ms.append(a)
        off_ms.append(b)
        diffs.append(a - b)
    return {
        "with": statistics.median(on_ms),
        "without": statistics.median(off_ms),
        "added": statistics.median(diffs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--keras-rounds", type=int, default=10)
    args = parser.parse_args()
    pth = site_packages(args.python) / PTH
    if not pth.exists():
        sys.exit(f"{pth} not found: install the plugin in that environment first")
    cases = [("python -c pass", "pass", args.rounds)]
    if args.keras_rounds:
        cases.append(('python -c "import keras"', "import keras", args.keras_rounds))
    print(f"{'program':28} {'rounds':>6} {'with':>9} {'without':>9} {'added':>8}")
    for label, code, rounds in cases:
        m = measure(args.python, code, rounds, pth)
        print(
            f"{label:28} {rounds:6d} {m['with']:8.1f}ms {m['without']:8.1f}ms "
            f"{m['added']:+7.1f}ms"
        )


if __name__ == "__main__":
    main()
