"""The launch path's host time per forward call against the GPU's time, for cases whose eager
time may be the host's (few heads, segments: several launches for little GPU work).

    python3 bench/probes/host_probe.py B1_T8192_H16 B1_T8192_H64 [--head-dim 128] [--bound]

host   wall time per call, 20 calls back to back (the GPU queues them), the fastest and
       slowest of five rounds
eager  bench.py's eager time (CUDA events, median of 100, input sets rotated)
graph  the same calls replayed as a CUDA graph (the GPU's time alone)
Where host approaches graph, the eager time is the host's. Cases as bench.parse_case takes them.
--bound: each case also as a bound call (kda_cute.bind of the same problem's plan, one per
input set, made at its first call: what a serving loop with fixed buffers calls), after the
eager `fwd` call (its checks, plan and resolved steps reused). An older revision's host time:
run this file from that revision's tree (scripts/ab_build.sh puts one in build/ab/<rev>/src).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.py (see bench/README.md)
import bench  # noqa: E402
import kda_cute  # noqa: E402


def host_ms(run, sets, calls: int = 20, rounds: int = 5) -> tuple[float, float]:
    """(fastest, slowest) round's wall ms per call."""
    per = []
    for _ in range(rounds):
        t = time.perf_counter()
        for i in range(calls):
            run(sets[i % len(sets)])
        per.append((time.perf_counter() - t) / calls * 1e3)
        torch.cuda.synchronize()
    return min(per), max(per)


def bound_runner(pl):
    """Each input set's call of plan `pl` bound (kda_cute.bind) at the set's first call, on the
    stream current then (a CUDA graph's capture stream for bench.graph_runner, which calls
    each set once before capturing); later calls only launch."""
    bound = {}

    def run(x):
        b = bound.get(id(x))
        if b is None:
            b = bound[id(x)] = kda_cute.bind(pl, bench.call_of(x), x["workspace"],
                                             check_seqlens=False)
        b()
    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bound", action="store_true",
                    help="also time the bound call (kda_cute.bind) of each case")
    args = ap.parse_args(argv)
    for name in args.cases:
        label, spec = bench.parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        runs = [("", bench.kda_runner)]
        if args.bound:
            p = bench.problem_of(sets[0], check_seqlens=False)
            opts = kda_cute.Options(precision=bench.PRECISION, segments=bench.SEGMENTS)
            pl = kda_cute.plan(p, opts, kda_cute.plans.device_info(sets[0]["q"].device))
            runs = [(" fwd", bench.kda_runner), (" bound", lambda _pl=pl: bound_runner(_pl))]
        for tag, make in runs:
            run = make()
            for i in range(10):
                run(sets[i % len(sets)])
            torch.cuda.synchronize()
            lo, hi = host_ms(run, sets)
            eager = bench.time_fn(run, sets, 100)
            captured = make()  # its own bound calls, on the capture stream; kept while replayed
            graph = bench.time_fn(bench.graph_runner(captured, sets), sets, 100)
            print(f"{label} K{args.head_dim}{tag}: host {lo:.3f}-{hi:.3f} ms/call, eager "
                  f"{eager:.3f} ms, graph {graph:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
