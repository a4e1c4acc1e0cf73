"""What the side runs of a checkpointed forward cost: the every-n form with a first offset
(checkpoint_first: every boundary may cut a chunk, so the plan runs K1's side run, the zeroing
of the side slots, K2's side run and its rescale run, each finding on the device what it has to
do) timed as planned and with its side steps edited (K2's side run with grid z 1, as a
programmatic dependent, left out, or its rescale run alone; K1's side run left out, or its grid
cut to about two CTAs an SM: timing only, mid-chunk checkpoints are then wrong), against the
same checkpoints without the first offset (no side runs) and the forward without checkpoints.
K = V = 128, fast precision; graph (two timings) and eager, CUDA events, cold L2, median of 100.
Since the rows' chunk grids shift to their first boundaries (kda_cute.specs.checkpoints), a plan
of the every-n form with a first offset has no side runs and so no variants here (the segments
schedule still has them): each mode then times the shift (the offsets kernel's tables, K1 over
each row in two) against the same boundaries without the first offset.

    python3 bench/probes/side_runs_probe.py ["B1 T8192 H64" ["every 64 bf16,every 1024 fp32"]]
    (the results of 2026-12-04: bench/results/wy-eight-stages-h200-2026-12-04.md)
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def call_with(x, kw):
    """kda_cute's Call of an input set (bench.call_of) with checkpoint arguments `kw` (fwd's
    names, checkpoints_probe.checkpoint_args)."""
    import bench

    return bench.call_of(x)._replace(**kw)


def variants(pl, sms: int = 132) -> dict:
    """The plan and its side-step edits (named); `sms`: the device's."""
    names = [s.name for s in pl.steps]
    out = {"plan": pl}
    if "K2 side" in names:
        s = pl.step("K2 side")
        out["K2 side z 1"] = pl.edit("K2 side", grid=(s.grid[0], s.grid[1], 1))
        out["K2 side programmatic"] = pl.edit("K2 side", programmatic=True)
        out["no K2 side runs"] = pl.without("K2 side", "K2 side rescale")
        if "K2 side rescale" in names:
            out["no K2 side rescale"] = pl.without("K2 side rescale")
        out["no K1 side"] = pl.without("K1 side")
        k1 = pl.step("K1 side")
        if getattr(k1.kernel, "looped", False):
            # as before the looped twin: the plain K1, a CTA a side slot and head
            from kda_cute.plans.device import H200, resources
            from kda_cute.specs.prep import K1_GRID_Y

            S = pl.problem.N * pl.problem.ckpt.per_row
            plain = dataclasses.replace(k1.kernel, looped=False)
            out["K1 side a CTA a slot"] = pl.edit(
                "K1 side", kernel=plain, smem=resources(plain, H200.arch).smem,
                grid=(k1.grid[0], min(S, K1_GRID_Y), -(-S // K1_GRID_Y)))
            # the looped run's grid: two resident waves, and about 8 and 2 CTAs an SM
            from kda_cute.plans.prefill import side_k1_rows

            ys = [side_k1_rows(k1.grid[0], H200, k1.kernel, 2)]
            ys += [-(-n * sms // k1.grid[0]) for n in (8, 2)]
            for y in dict.fromkeys(min(S, y) for y in ys if min(S, y) != k1.grid[1]):
                out[f"K1 side looped, grid y {y}"] = pl.edit("K1 side", grid=(k1.grid[0], y, 1))
        else:
            y = min(k1.grid[1], -(-2 * sms // k1.grid[0]))  # about two CTAs an SM
            out[f"K1 side grid y {y}"] = pl.edit("K1 side", grid=(k1.grid[0], y, 1))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("cases", nargs="?", default="B1 T8192 H64,varlen mix H64",
                    help="comma-separated, of bench.CASES")
    ap.add_argument("modes", nargs="?", default="every 64 bf16,every 1024 fp32",
                    help="comma-separated every-n modes of checkpoints_probe.py")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=0,
                    help="> 0: after a warm-up (--warm-s), time each mode's graphs in this many "
                         "rounds of plan, variant 1, plan, variant 2, ..., plan and print each "
                         "variant over the mean of the plan's timings either side of it (the "
                         "median over rounds), so the clock drift falls on both alike")
    ap.add_argument("--warm-s", type=float, default=10.0)
    a = ap.parse_args(argv)
    for p in (ROOT, ROOT / "bench", ROOT / "bench" / "probes"):
        sys.path.insert(0, str(p))
    import checkpoints_probe as cp

    import bench
    from kda_cute import checks, launch, plans
    from kda_cute.plans.device import device_info

    for case in a.cases.split(","):
        if case not in bench.CASES:
            raise SystemExit(f"cases: expected some of {list(bench.CASES)}, got {case!r}")
        sets = bench.input_sets(bench.CASES[case], 128, workspace=False)
        opts = checks.options("bounded", True, True, None, None, "fast")
        dev = device_info(sets[0]["q"].device)
        modes = {}
        for m in a.modes.split(","):
            if not m.startswith("every ") or m not in cp.MODES:
                raise SystemExit(f"modes: expected every-n modes of {cp.MODES}, got {m!r}")
            kw, _ = cp.checkpoint_args(sets[0], m)
            aligned = {k: v for k, v in kw.items() if k != "checkpoint_first"}
            modes[m], modes[m + " aligned"] = kw, aligned
        modes["none"] = {}
        cp.give_workspace(sets, list(modes.values()))
        for m, kw in modes.items():
            pl = plans.plan(checks.forward(call_with(sets[0], kw), opts, False), opts, dev)
            if a.rounds > 0:
                vs = variants(pl, dev.sms)
                if len(vs) < 2:
                    continue
                graphs = {name: bench.graph_runner(
                    lambda x, v=v, kw=kw: launch.run(v, call_with(x, kw), x["ck_workspace"]),
                    sets) for name, v in vs.items()}
                cp._warm(graphs["plan"], sets, a.warm_s)
                others = [n for n in graphs if n != "plan"]
                base, times = [], {n: [] for n in others}
                for _ in range(a.rounds):
                    base.append(bench.time_fn(graphs["plan"], sets, a.iters))
                    for n in others:
                        times[n].append(bench.time_fn(graphs[n], sets, a.iters))
                        base.append(bench.time_fn(graphs["plan"], sets, a.iters))
                for i, n in enumerate(others):
                    r = cp.paired(base, times[n], i, len(others) + 1)
                    print(f"{case} | {m} | {n} | graph paired {r:.4f} of the plan's "
                          f"{statistics.median(base):.4f}", flush=True)
                continue
            for name, v in variants(pl, dev.sms).items():
                def run(x, v=v, kw=kw):
                    launch.run(v, call_with(x, kw), x["ck_workspace"])
                g = bench.graph_runner(run, sets)
                gs = [bench.time_fn(g, sets, a.iters) for _ in range(2)]
                e = bench.time_fn(run, sets, a.iters)
                print(f"{case} | {m} | {name} | graph {gs[0]:.4f} {gs[1]:.4f} | eager {e:.4f}",
                      flush=True)


if __name__ == "__main__":
    main()
