"""The launch path's host time per forward call against the GPU's time, for cases whose eager
time may be the host's (few heads, segments: several launches for little GPU work).

    python3 bench/host_probe.py B1_T8192_H16 B1_T8192_H64 [--head-dim 128] [--replay 0,1]

host   wall time per call of the eager forward, 20 calls back to back (the GPU queues them),
       the fastest and slowest of five rounds
eager  bench.py's eager time (CUDA events, median of 100, input sets rotated)
graph  the same forward replayed as a CUDA graph (the GPU's time alone)
Where host approaches graph, the eager time is the host's. Cases as kernel_times.py takes them.
--replay: each case with KDA_CUTE_REPLAY set to each value in turn (0: every call takes the
full launch path; 1: repeated calls replay the first one's launches).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from kernel_times import parse_case  # noqa: E402

import bench  # noqa: E402


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--replay", default=None, help="KDA_CUTE_REPLAY values to compare, e.g. 0,1")
    args = ap.parse_args(argv)
    for name in args.cases:
        label, spec = parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        run = bench.kda_runner()
        for replay in (args.replay.split(",") if args.replay else [None]):
            if replay is not None:
                os.environ["KDA_CUTE_REPLAY"] = replay
            for i in range(10):
                run(sets[i % len(sets)])
            torch.cuda.synchronize()
            lo, hi = host_ms(run, sets)
            eager = bench.time_fn(run, sets, 100)
            graph = bench.time_fn(bench.graph_runner(run, sets), sets, 100)
            tag = "" if replay is None else f" replay={replay}"
            print(f"{label} K{args.head_dim}{tag}: host {lo:.3f}-{hi:.3f} ms/call, eager "
                  f"{eager:.3f} ms, graph {graph:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
