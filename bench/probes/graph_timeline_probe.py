"""A forward's kernels on the GPU's clock, eager against CUDA graph: for each case, the forward
timed as bench.py times it (CUDA events, cold L2, median), then 30 calls of each kind under
torch.profiler, every kernel's start (from the call's first kernel's start) and duration, the
medians over calls. Shows where a graph's time differs from the eager call's: a kernel that runs
longer, or a gap between kernels. K = V = 128, fast precision, the caller's workspace.
--variants: instead, eager and graph timed (twice) for the forward's plan as made, with its K2
rescale run an ordinary launch, and without it (timing only), and for fwd itself.

    python3 bench/probes/graph_timeline_probe.py "varlen mix H64" "B8 T1024 H64" ...
    (a bench.py case, or B<b>_T<t>_H<h> / V<len>x<n>_H<h> as kernel_times.py takes)
    (the results of 2026-12-04: bench/results/wy-eight-stages-h200-2026-12-04.md)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def timeline(run, sets, calls: int):
    """Per kernel position in a call: (name, median start us from the call's first kernel,
    median duration us), and the median span of a call (first start to last end)."""
    import bench

    ks = sorted(((ev.time_range.start, ev.time_range.end, ev.name)
                 for ev in bench.gpu_events(run, sets, calls)
                 if "elementwise" not in ev.name), key=lambda t: t[0])
    if len(ks) % calls:
        return {"error": f"{len(ks)} kernel records over {calls} calls",
                "names": sorted({n for _, _, n in ks})}
    per = len(ks) // calls
    rows, spans = [], []
    for c in range(calls):
        one = ks[c * per:(c + 1) * per]
        t0 = one[0][0]
        rows.append([(n, s - t0, e - s) for s, e, n in one])
        spans.append(max(e for _, e, _ in one) - t0)
    out = []
    for j in range(per):
        out.append((rows[0][j][0][:60], statistics.median(r[j][1] for r in rows),
                    statistics.median(r[j][2] for r in rows)))
    return {"kernels": out, "span_us": statistics.median(spans)}


def plan_variants(x) -> dict:
    """The forward's plan for input set `x` as made, with its K2 rescale run not programmatic,
    and without it (named); None: fwd itself."""
    import bench
    from kda_cute import checks, plans
    from kda_cute.plans.device import device_info

    p = bench.problem_of(x, check_seqlens=False)
    opts = checks.options("bounded", True, True, None, None, "fast")
    pl = plans.plan(p, opts, device_info(x["q"].device))
    out = {"plan": pl}
    if "K2 rescale" in [s.name for s in pl.steps]:
        out["rescale not programmatic"] = pl.edit("K2 rescale", programmatic=False)
        out["no rescale"] = pl.without("K2 rescale")
    out["fwd"] = None
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument("--variants", action="store_true",
                    help="time the plan's rescale-run variants instead of the timelines")
    a = ap.parse_args(argv)
    for p in (ROOT, ROOT / "bench", ROOT / "bench" / "probes"):
        sys.path.insert(0, str(p))
    import kernel_times

    import bench

    res = {}
    for name in a.cases:
        label, spec = kernel_times.parse_case(name)
        sets = bench.input_sets(spec, 128)
        if a.variants:
            for vn, v in plan_variants(sets[0]).items():
                run = bench.kda_runner() if v is None else bench.plan_runner(v)
                graph = bench.graph_runner(run, sets)
                for _ in range(2):
                    e, g = bench.time_fn(run, sets, a.iters), bench.time_fn(graph, sets, a.iters)
                    print(f"{label} | {vn} | eager {e:.4f} | graph {g:.4f} | {g / e - 1:+.1%}",
                          flush=True)
            continue
        run = bench.kda_runner()
        graph = bench.graph_runner(run, sets)
        r = {"eager_ms": bench.time_fn(run, sets, a.iters),
             "graph_ms": bench.time_fn(graph, sets, a.iters)}
        for kind, fn in (("eager", run), ("graph", graph)):
            r[kind] = timeline(fn, sets, a.calls)
        res[label] = r
        print(f"{label}: eager {r['eager_ms']:.4f} ms, graph {r['graph_ms']:.4f} ms", flush=True)
        for kind in ("eager", "graph"):
            t = r[kind]
            if "error" in t:
                print(f"  {kind}: {t}")
                continue
            print(f"  {kind}: span {t['span_us']:.1f} us; " + "; ".join(
                f"{n} @{s:.1f} {d:.1f}us" for n, s, d in t["kernels"]), flush=True)
    print(json.dumps({"versions": bench.versions(), "cases": res}))


if __name__ == "__main__":
    main()
