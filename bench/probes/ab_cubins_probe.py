"""Two cubin sets of the same ABI timed in one process, each mode beside the other set's: the
shipped cubins (or --new DIR) against --old DIR, every forward captured once per set in a CUDA
graph (the graphs keep the functions of the set they were captured with), then replayed in
turn, round after round: none@new, mode@new, none@old, mode@old, ... So the GPU's clock drift
under its power cap (docs/notes/method.md) falls on both sets alike, which separate processes
(KDA_CUTE_CUBIN_DIR) do not give. Each mode: new / old in ms (the median over rounds of the
ratio of adjacent timings) and each set's cost over its own forward without (paired). K = V =
128, fast precision, checkpoints_probe's modes.

    python3 bench/probes/ab_cubins_probe.py --old DIR [--new DIR] [--cases A,B]
        [--modes "none,every 64 bf16"] [--rounds 5] [--iters 50] [--warm-s 10] [--out JSON]
    (DIR: a cubin root, the folder that holds sm_90a/: build/ab/REV from scripts/ab_build.sh)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def use_cubins(root: Path) -> None:
    """Load kernels from cubin root `root` from now on: the manifests read again, the loaded
    kernels forgotten (what was resolved or captured against them keeps them)."""
    from kda_cute import cubin
    from kda_cute.launch import driver

    cubin.CUBIN_ROOT = Path(root)
    cubin.manifest.cache_clear()
    driver.clear()


def cubin_roots(new, old) -> dict:
    """{"new": .., "old": ..}: the cubin roots given (new None: the shipped cubins), each
    checked to hold sm_90a/."""
    from kda_cute import cubin

    roots = {"new": Path(new) if new else cubin.CUBIN_ROOT, "old": Path(old)}
    for name, r in roots.items():
        if not (r / "sm_90a").is_dir():
            raise SystemExit(f"--{name}: expected a cubin root holding sm_90a/, got {r}")
    return roots


def summary(rounds: list[dict], m: str) -> dict:
    """A mode's figures from its rounds ({"none@new", m + "@new", "none@old", m + "@old"} ms
    each): new over old for it and for the forward without (medians of the rounds' ratios),
    and each set's cost over its own forward without (paired within the round)."""
    med = lambda f: statistics.median(f(t) for t in rounds)  # noqa: E731
    return {"new_over_old": med(lambda t: t[f"{m}@new"] / t[f"{m}@old"]),
            "none_new_over_old": med(lambda t: t["none@new"] / t["none@old"]),
            **{f"cost_{w}": med(lambda t, w=w: t[f"{m}@{w}"] / t[f"none@{w}"] - 1)
               for w in ("new", "old")}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True)
    ap.add_argument("--new", default=None, help="default: the shipped cubins")
    ap.add_argument("--cases", default="B1 T8192 H64,varlen mix H64")
    ap.add_argument("--modes", default="none,every 64 bf16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warm-s", type=float, default=10.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    for p in (ROOT, ROOT / "bench", ROOT / "bench" / "probes"):
        sys.path.insert(0, str(p))
    import checkpoints_probe as cp

    import bench

    roots = cubin_roots(a.new, a.old)
    modes = a.modes.split(",")
    if modes[0] != "none" or any(m not in cp.MODES for m in modes):
        raise SystemExit(f"--modes: expected 'none' first, then some of {cp.MODES}")
    res = {"versions": bench.versions(), "roots": {k: str(v) for k, v in roots.items()},
           "rows": []}
    for case in a.cases.split(","):
        sets = bench.input_sets(bench.CASES[case], 128, workspace=False)
        args = {m: cp.checkpoint_args(sets[0], m)[0] for m in modes}
        cp.give_workspace(sets, list(args.values()))
        graphs = {}
        for which, r in roots.items():
            use_cubins(r)
            for m in modes:
                graphs[(m, which)] = bench.graph_runner(cp.runner(args[m]), sets)
        cp._warm(graphs[("none", "new")], sets, a.warm_s)
        # a round: for each mode, none@new, mode@new, none@old, mode@old; pairs[m] holds each
        # round's four timings
        pairs = {m: [] for m in modes[1:]}
        for _ in range(a.rounds):
            for m in modes[1:]:
                pairs[m].append({f"{x}@{w}": bench.time_fn(graphs[(x, w)], sets, a.iters)
                                 for w in ("new", "old") for x in ("none", m)})
        row = {"case": case, "rounds": pairs, "modes": {}}
        for m in modes[1:]:
            row["modes"][m] = r = summary(pairs[m], m)
            print(f"{case} | {m} | new/old {r['new_over_old']:.3f} (none "
                  f"{r['none_new_over_old']:.3f}) | cost new {r['cost_new']:+.1%} old "
                  f"{r['cost_old']:+.1%}", flush=True)
        res["rows"].append(row)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
