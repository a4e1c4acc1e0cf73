"""What the fast forward's rescale runs cost: `fwd` on ordinary values (the rescale runs find
nothing flagged), on values past fp16's range in one sequence or head, and everywhere (every
state row redone), timed in one process (CUDA events, warm-up, median of --iters, input sets
rotated for a cold L2; eager and replayed as a CUDA graph), K = V = 128, with each mode's
accuracy against float64 on its first set.

    python3 bench/probes/rescale_probe.py [--iters N] [--cases "A,B"] [--out JSON]
    python3 bench/probes/rescale_probe.py --range [--out JSON]   (accuracy only: v and the
        initial state times 2^e, e from -24 to 100, both precisions, B1 T1024 H4)
    python3 bench/probes/rescale_probe.py --noop [--iters N] [--out JSON]   (the rescale runs'
        cost when nothing overflows: each case of bench.py's table as planned, and its plan
        without the rescale runs, as CUDA graphs)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ("B1 T8192 H64", "varlen mix H64", "B32 T256 H32", "B1 T8192 H16")
MODES = ("ordinary", "one head x 2^16", "all x 2^16")


def _imports():
    sys.path.insert(0, str(ROOT))
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))
    import bench
    return bench


def scaled(x, mode: str) -> None:
    """Scale v and the initial state of set x in place (powers of two: exact in bf16)."""
    import torch

    if mode == "ordinary":
        return
    s = 2.0 ** 16
    if mode.startswith("one head"):
        v = x["v"].float()
        v[:, :, 1] *= s
        x["v"] = v.to(torch.bfloat16)
        x["initial_state"][:, 1] *= s
    else:
        x["v"] = (x["v"].float() * s).to(torch.bfloat16)
        x["initial_state"].mul_(s)


EXPONENTS = (-24, -20, -16, -12, -8, -4, 0, 8, 12, 14, 15, 16, 18, 20, 40, 100)


def value_range() -> list[dict]:
    """Output and fp32 state errors against float64 with v and S0 scaled by 2^e."""
    import torch

    from kda_cute.testing import errors, make_inputs

    base = make_inputs(B=1, T=1024, H=4, K=128, seed=5)
    rows = []
    for e in EXPONENTS:
        x = dict(base, v=(base["v"].float() * 2.0 ** e).to(torch.bfloat16),
                 initial_state=base["initial_state"] * 2.0 ** e)
        row = {"exp": e, "max_v": float(x["v"].float().abs().max())}
        for precision in ("fast", "precise"):
            r = errors(x, precision=precision)
            row[precision] = {k: r[k] for k in ("out_err", "state_err", "out_finite",
                                                "state_finite")}
        print(f"2^{e:<4d} max|v| {row['max_v']:.2e}  fast {row['fast']['out_err']:.2e} / "
              f"{row['fast']['state_err']:.2e}  precise {row['precise']['out_err']:.2e} / "
              f"{row['precise']['state_err']:.2e}", flush=True)
        rows.append(row)
    return rows


def noop(bench, iters: int) -> list[dict]:
    """Graph ms of each table case's plan with and without its rescale runs (ordinary values:
    nothing flagged, so the plan without them computes the same)."""
    from kda_cute import Options, plan
    from kda_cute.plans import device_info

    rows = []
    for name, spec in bench.CASES.items():
        sets = bench.input_sets(spec, 128)
        p = bench.problem_of(sets[0], check_seqlens=False)
        pl = plan(p, Options(), device_info(0))
        bare = pl.only(*(s.name for s in pl.steps if not s.name.endswith(" rescale")))
        r = {"case": name, "schedule": str(pl.schedule)}
        for key, q in (("with", pl), ("without", bare), ("with again", pl)):
            run = bench.plan_runner(q)
            r[key] = bench.time_fn(bench.graph_runner(run, sets), sets, iters)
        r["rescale_us"] = 1e3 * (min(r["with"], r["with again"]) - r["without"])
        print(f"{name:18s} {r['schedule']:11s} with {r['with']:.4f} without {r['without']:.4f} "
              f"again {r['with again']:.4f}  rescale runs {r['rescale_us']:+.1f} us", flush=True)
        rows.append(r)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--range", action="store_true")
    ap.add_argument("--noop", action="store_true")
    a = ap.parse_args(argv)
    bench = _imports()
    import torch

    if a.noop:
        res = {"versions": bench.versions(), "noop": noop(bench, a.iters)}
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
        return

    if a.range:
        res = {"versions": bench.versions(), "range": value_range()}
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))
        return

    import kda_cute
    from kda_cute.reference import rel_err

    rows = []
    for name in a.cases.split(","):
        row = {"case": name, "modes": {}}
        for mode in MODES:
            sets = bench.input_sets(bench.CASES[name], 128)
            for x in sets:
                scaled(x, mode)
            fn = bench.kda_runner()
            eager = bench.time_fn(fn, sets, a.iters)
            graph = bench.time_fn(bench.graph_runner(fn, sets), sets, a.iters)
            x = sets[0]
            x["out"].fill_(float("nan"))
            x["final_state"].fill_(float("nan"))
            fn(x)
            torch.cuda.synchronize()
            kda_cute.check_errors(sync=True)
            ref_o, ref_s = bench.reference(x)
            r = {"eager": eager, "graph": graph, "out_err": rel_err(x["out"], ref_o),
                 "state_err": rel_err(x["final_state"], ref_s)}
            row["modes"][mode] = r
            print(f"{name:18s} {mode:16s} eager {eager:.3f} graph {graph:.3f} "
                  f"out {r['out_err']:.2e} state {r['state_err']:.2e}", flush=True)
        rows.append(row)
    res = {"versions": bench.versions(), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
