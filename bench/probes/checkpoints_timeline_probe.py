"""Kernel timelines of a checkpointed forward, eager against a CUDA graph (torch.profiler).

A checkpointed forward on varlen mix H64 costs 1.5-3.5 points more over the forward without
when called eagerly than when replayed in a graph, while B1 T8192 H64 costs the same both ways
(`bench/results/checkpoints-bars-h200-2026-12-05-208f73c.md`); the launcher's own host time is
31-38 us a call against 0.53 ms of GPU work. This records, for each case and mode, eight eager
calls then eight graph replays with every kernel's start, end and stream, to see where the
eager calls lose the time (the side stream's checkpoints kernel and K1 side run, the join
before K2, the side runs after it).

    python3 bench/probes/checkpoints_timeline_probe.py --out timeline.json
    python3 bench/probes/checkpoints_timeline_probe.py --read timeline.json  (the summary)
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


# kernel names (the DSL's mangled entry names) by the class they hold
SHORT = (("KdaOffsets", "offsets"), ("KdaCheckpoints", "ckpts"), ("KdaPrep", "K1"),
         ("KdaRecurTc", "K2"), ("emset", "memset"))


def summary(timelines: dict) -> list[str]:
    """Per case and mode: the median period of the eight eager calls and of the eight graph
    replays, and the middle call's kernels as name@start+duration (us from the call's first
    kernel; s0, s1: the streams in order of their ids). A call starts at its offsets kernel,
    or without one at its K1 of over 50 us."""
    import statistics

    def short(n):
        return next((b for a, b in SHORT if a in n), n[:20])

    lines = []
    for key, ev in timelines.items():
        ev = sorted((dict(e, s=short(e["name"])) for e in ev), key=lambda e: e["start"])
        first = "offsets" if any(e["s"] == "offsets" for e in ev) else "K1"
        starts = [i for i, e in enumerate(ev) if e["s"] == first
                  and (first == "offsets" or e["end"] - e["start"] > 50)]
        calls = [ev[a:b] for a, b in zip(starts, starts[1:] + [len(ev)], strict=True)]
        lines.append(f"== {key}: {len(calls)} calls")
        for half, cs in (("eager", calls[:8]), ("graph", calls[8:16])):
            if not cs:
                continue
            gaps = [b[0]["start"] - a[0]["start"] for a, b in zip(cs[:-1], cs[1:], strict=True)]
            c = cs[len(cs) // 2]
            streams = sorted({e["stream"] for e in c})
            lines.append(f"  {half}: period {statistics.median(gaps) if gaps else 0:.1f} us; "
                         + "; ".join(f"{e['s']}@{e['start'] - c[0]['start']:.0f}"
                                     f"+{e['end'] - e['start']:.0f} s{streams.index(e['stream'])}"
                                     for e in c))
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--read", default=None, help="print the summary of an --out file")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args(argv)
    if a.read:
        print("\n".join(summary(json.loads(Path(a.read).read_text())["timelines"])))
        return
    if not a.out:
        ap.error("--out or --read is required")
    import bench
    out = {"versions": bench.versions(), "timelines": {}}
    for case in a.cases.split(","):
        for mode in a.modes.split(","):
            out["timelines"][f"{case} | {mode}"] = ev = record(case, mode)
            print(case, mode, len(ev), "events", flush=True)
    Path(a.out).write_text(json.dumps(out) + "\n")
    print("\n".join(summary(out["timelines"])))


if __name__ == "__main__":
    main()
