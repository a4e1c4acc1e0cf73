"""Where a checkpointed forward's time goes, kernel by kernel: `fwd` with each checkpoint mode
timed (CUDA events, cold L2, median of 100; eager and CUDA graph) and its kernels' durations
read from torch.profiler over 20 eager calls (per kind: launches a call, median duration; a
launch released early by programmatic dependent launch counts from its release). K = V = 128,
fast precision.

Modes beyond checkpoints_probe.py's: "every 1024 fp32 aligned" (no checkpoint_first: every
boundary ends a chunk, so no side runs), "offsets end" (one checkpoint, at each sequence's end),
"offsets unused" (a table of -1: the checkpoints build with nothing to store).

    python3 bench/probes/checkpoint_nodes_probe.py ["B1 T8192 H64" ["none,offsets end"]]
    (the results of 2026-12-04: bench/results/checkpoints-fork-h200-2026-12-04.md)
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MODES = ("none", "offsets 1024 fp32", "every 1024 fp32", "every 1024 fp32 aligned",
         "offsets end", "offsets unused", "every 64 bf16", "every 64 bf16 aligned")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("case", nargs="?", default="B1 T8192 H64", help="one of bench.CASES")
    ap.add_argument("modes", nargs="?", default=",".join(MODES),
                    help=f"comma-separated, of {', '.join(MODES)}")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    for p in (ROOT / "bench", ROOT / "bench" / "probes"):
        sys.path.insert(0, str(p))
    import checkpoints_probe as cp
    import torch

    import bench

    case, modes = a.case, a.modes.split(",")
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"modes: expected some of {MODES}, got {m!r}")
    sets = bench.input_sets(bench.CASES[case], 128, workspace=False)

    def args(x, m):
        if m in ("offsets end", "offsets unused"):
            lens = cp.lengths(x)
            H, V, K = x["v"].shape[2], x["v"].shape[3], x["q"].shape[3]
            offs = torch.tensor([[n if m == "offsets end" else -1] for n in lens],
                                dtype=torch.int32)
            cs = torch.empty(len(lens), 1, H, V, K, dtype=torch.float32, device="cuda")
            return {"checkpoint_state": cs, "checkpoint_offsets": offs.cuda()}
        if m.endswith(" aligned"):
            kw, _ = cp.checkpoint_args(x, m[:-len(" aligned")])
            kw.pop("checkpoint_first")
            return kw
        return cp.checkpoint_args(x, m)[0]

    kws = {m: args(sets[0], m) for m in modes}
    cp.give_workspace(sets, list(kws.values()))
    res = {}
    for m in modes:
        run = cp.runner(kws[m])
        g = bench.time_fn(bench.graph_runner(run, sets), sets, 100)
        e = bench.time_fn(run, sets, 100)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for i in range(20):
                run(sets[i % len(sets)])
            torch.cuda.synchronize()
        k = collections.defaultdict(list)
        for ev in prof.events():
            if ev.device_type == torch.autograd.DeviceType.CUDA:
                k[ev.name].append(ev.time_range.elapsed_us())
        ks = {n[:70]: (len(v) // 20, sorted(v)[len(v) // 2]) for n, v in k.items()}
        res[m] = {"graph": g, "eager": e, "kernels": ks}
        print(f"{case} | {m} | graph {g:.4f} | eager {e:.4f} | "
              + "; ".join(f"{n} x{c} {t:.1f}us" for n, (c, t) in ks.items()), flush=True)
    print(json.dumps({"versions": bench.versions(), "case": case, "modes": res}))


if __name__ == "__main__":
    main()
