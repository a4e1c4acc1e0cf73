"""The host's share of a forward: how long `fwd` takes to return (launches queued, GPU not
waited on), per call, and where that time goes (cProfile), for the benchmark's cases.

    python3 bench/probes/host_profile.py "B1 T8192 H16" "B1 T8192 H64" --head-dim 128

Where the host time per call exceeds the GPU time, eager timings measure the host: the GPU
idles between launches. The GPU time is printed beside it (CUDA graph replay, as bench.py).
"""

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench import CASES, case_inputs, graph_runner, kda_runner, problem_of, time_fn  # noqa: E402
from kda_cute import api  # noqa: E402


def host_ms(fn, x, calls: int) -> float:
    """Median over rounds of the mean wall time per call of `calls` back-to-back calls,
    with the GPU drained before each round (so no call waits on a full launch queue)."""
    rounds = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn(x)
        rounds.append((time.perf_counter() - t0) * 1e3 / calls)
    torch.cuda.synchronize()
    return sorted(rounds)[len(rounds) // 2]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+", help="case names of bench.py ('_' for ' ')")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    for name in a.cases:
        name = name.replace("_", " ")
        x = case_inputs(CASES[name], a.head_dim, seed=0)
        x["out"] = torch.empty_like(x["v"])
        x["final_state"] = torch.empty_like(x["initial_state"])
        pr = problem_of(x)
        x["workspace"] = torch.empty(api.workspace_bytes(pr, api.config_for(pr)),
                                     dtype=torch.uint8, device="cuda")
        run = kda_runner()
        for _ in range(3):
            run(x)
        torch.cuda.synchronize()
        h = host_ms(run, x, a.calls)
        eager = time_fn(run, [x], 50)
        graph = time_fn(graph_runner(run, [x]), [x], 50)
        print(f"{name} K{a.head_dim}: host {h:.3f} ms per call, eager {eager:.3f} ms, "
              f"graph {graph:.3f} ms")
        prof = cProfile.Profile()
        torch.cuda.synchronize()
        prof.enable()
        for _ in range(a.calls):
            run(x)
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.top)
        print(s.getvalue())


if __name__ == "__main__":
    main()
