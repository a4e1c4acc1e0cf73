"""Each kernel's own GPU time in a forward (the profiler's kernel records, no host gaps), for
benchmark cases or ad-hoc shapes, inputs rotated as in bench.py so the L2 is cold.

    python3 bench/probes/kernel_times.py "B1 T8192 H64" B8_T1024_H64 V1024x8_H64 \
        --head-dim 128

A case is what bench.parse_case takes: a bench.py case name ('_' for ' '), "B<b>_T<t>_H<h>" or
"V<len>x<n>_H<h>". Prints the median duration of every kernel the forward launches (K1, K2, and
any small torch kernels), and their sum. Eager and graph timings in bench.py also count the gaps
between launches; this does not. --states in,out / in / out / none: which of the initial and
final states the forward reads and writes (default both; the others show what K2's state
traffic costs). --config NAME: the forward whose K2 (or K1) config has that name
(ladder.SHIPPED + EXPERIMENTAL), not the ladder's. --segments P: K2 over P segments a sequence
(a fixed-length batch; 1: none), not the launcher's choice.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.py (see bench/README.md)
import bench  # noqa: E402


def kernel_times(spec, K: int, iters: int, states: str = "in,out",
                 config=None) -> dict[str, float]:
    """Each kernel's GPU ms per forward over `iters` forwards (bench.gpu_kernel_ms); `states`
    says which of the initial ("in") and final ("out") states the forwards use."""
    sets = bench.input_sets(spec, K, workspace=False)
    for x in sets:
        if "out" not in states.split(","):
            x["final_state"] = None
        if "in" not in states.split(","):
            x["initial_state"] = None
    return bench.gpu_kernel_ms(bench.kda_runner(config), sets, iters)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--states", default="in,out", choices=["in,out", "in", "out", "none"])
    ap.add_argument("--config", default=None)
    ap.add_argument("--segments", type=int, default=0)
    a = ap.parse_args(argv)
    bench.SEGMENTS = a.segments or None
    config = None
    if a.config:
        from kda_cute.ladder import EXPERIMENTAL, SHIPPED
        config = next((c for c in SHIPPED + EXPERIMENTAL
                       if a.config in (c.recur.name, c.prep.name)), None)
        if config is None:
            raise SystemExit(f"--config: no shipped or experimental config named {a.config!r}")
    for name in a.cases:
        label, spec = bench.parse_case(name)
        times = kernel_times(spec, a.head_dim, a.iters, a.states, config)
        print(f"{label} K{a.head_dim} states {a.states} {a.config or 'ladder'}"
              f"{f' segments {a.segments}' if a.segments else ''}: "
              f"sum {sum(times.values()):.3f} ms")
        for kname, ms in sorted(times.items(), key=lambda kv: -kv[1]):
            print(f"    {ms:8.4f} ms  {kname[:90]}")


if __name__ == "__main__":
    main()
