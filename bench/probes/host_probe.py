"""The launch path's host time per forward call against the GPU's time, for cases whose eager
time may be the host's (few heads, segments: several launches for little GPU work).

    python3 bench/probes/host_probe.py B1_T8192_H16 B1_T8192_H64 [--head-dim 128] [--bound]

host   wall time per call, 20 calls back to back (the GPU queues them), the fastest and
       slowest of five rounds
eager  bench.py's eager time (CUDA events, median of 100, input sets rotated)
graph  the same calls replayed as a CUDA graph (the GPU's time alone)
Where host approaches graph, the eager time is the host's. Cases as kernel_times.py takes them.
--bound: each case also as a bound call (kda_cute.bind of the same problem's plan, one per
input set, made at its first call: what a serving loop with fixed buffers calls), after the
eager `fwd` call (its checks, plan and resolved steps reused).
--tree DIR: time the kda_cute of DIR instead of this checkout's, e.g. an older revision that
scripts/ab_build.sh put in build/ab/<rev>/src (with KDA_CUTE_CUBIN_DIR=build/ab/<rev>): only
its kda_cute is imported (fwd, the checks and the workspace size, which older revisions have
too), never its bench files; --bound needs a kda_cute with `bind`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


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


def bound_runner(bench, pl):
    """Each input set's call of plan `pl` bound (kda_cute.bind) at the set's first call, on the
    stream current then (a CUDA graph's capture stream for bench.graph_runner, which calls
    each set once before capturing); later calls only launch."""
    import kda_cute

    bound = {}

    def run(x):
        b = bound.get(id(x))
        if b is None:
            b = bound[id(x)] = kda_cute.bind(pl, bench.call_of(x), x["workspace"],
                                             check_seqlens=False)
        b()
    return run


def _imports(tree: str | None):
    """(bench, parse_case), kda_cute imported first from `tree` (None: this checkout), so that
    bench.py, which imports kda_cute, takes that one (a `bench` folder there is no module:
    bench.py is found here)."""
    sys.path.insert(0, str(Path(tree).resolve() if tree is not None else ROOT))
    import kda_cute  # noqa: F401

    for d in (ROOT / "bench", ROOT / "bench" / "probes"):
        if str(d) not in sys.path:
            sys.path.append(str(d))
    from kernel_times import parse_case

    import bench
    return bench, parse_case


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--bound", action="store_true",
                    help="also time the bound call (kda_cute.bind) of each case")
    ap.add_argument("--tree", default=None,
                    help="the tree whose kda_cute to time (default: this checkout)")
    args = ap.parse_args(argv)
    bench, parse_case = _imports(args.tree)
    import kda_cute

    print(f"kda_cute from {Path(kda_cute.__file__).parent}", flush=True)
    if args.bound and not hasattr(kda_cute, "bind"):
        ap.error("--bound: this kda_cute has no bind")
    for name in args.cases:
        label, spec = parse_case(name)
        sets = bench.input_sets(spec, args.head_dim)
        runs = [("", bench.kda_runner)]
        if args.bound:
            p = bench.problem_of(sets[0], check_seqlens=False)
            opts = kda_cute.Options(precision=bench.PRECISION, segments=bench.SEGMENTS)
            pl = kda_cute.plan(p, opts, kda_cute.plans.device_info(sets[0]["q"].device))
            runs = [(" fwd", bench.kda_runner),
                    (" bound", lambda _pl=pl: bound_runner(bench, _pl))]
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
