"""Kernel timelines of a checkpointed forward, eager against a CUDA graph (torch.profiler).

A checkpointed forward on varlen mix H64 costs 1.5-3.5 points more over the forward without
when called eagerly than when replayed in a graph, while B1 T8192 H64 costs the same both ways
(`bench/results/checkpoints-bars-h200-2026-12-05-208f73c.md`); the launcher's own host time is
31-38 us a call against 0.53 ms of GPU work. This records, for each case and mode, eight eager
calls then eight graph replays with every kernel's start, end and stream, to see where the
eager calls lose the time (the side stream's checkpoints kernel and K1 side run, the join
before K2, the side runs after it).

    python3 bench/probes/checkpoints_timeline_probe.py --out timeline.json
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / "bench" / "probes")]

CASES = ("varlen mix H64", "B1 T8192 H64")
MODES = ("none", "every 1024 fp32", "every 64 bf16 no first")


def record(case: str, mode: str, calls: int = 8) -> list:
    import checkpoints_probe as cp
    import torch
    from torch.profiler import ProfilerActivity, profile

    import bench

    sets = bench.input_sets(bench.CASES[case], 128, workspace=False)
    kw, _ = cp.checkpoint_args(sets[0], mode)
    cp.give_workspace(sets, [kw])
    run = cp.runner(kw)
    graph = bench.graph_runner(run, sets)
    cp._warm(run, sets, 2.0)  # (the clocks settle under load first)
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for fn in (run, graph):
            for _ in range(calls):
                fn(sets[0])
            torch.cuda.synchronize()
    ev = [{"name": e.name[:80], "start": e.time_range.start, "end": e.time_range.end,
           "stream": getattr(e, "device_resource_id", None)}
          for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(ev, key=lambda e: e["start"])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args(argv)
    import bench
    out = {"versions": bench.versions(), "timelines": {}}
    for case in a.cases.split(","):
        for mode in a.modes.split(","):
            out["timelines"][f"{case} | {mode}"] = ev = record(case, mode)
            print(case, mode, len(ev), "events", flush=True)
    Path(a.out).write_text(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
