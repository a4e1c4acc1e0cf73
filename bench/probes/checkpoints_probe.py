"""A forward's cost of writing checkpoints: `fwd` with and without them, timed in one process
(CUDA events, warm-up, median of --iters, input sets rotated for a cold L2; eager and replayed
as a CUDA graph), K = V = 128 (--head-dim), fast precision (--precision).

Modes: one fp32 checkpoint per 1024 tokens (checkpoint_offsets at 1024, 2048, ... of each
sequence); one fp32 per 1024 and one per 64 tokens into a pool (checkpoint_slots with
checkpoint_every 1024 or 64, fp32 and bf16), on chunk boundaries (first = every) and mid-chunk
(first = every - 24: every one a partial chunk for the side runs), and on chunk boundaries
without a first offset (no first: the plan knows they are aligned; no side runs). The extra
bytes each mode writes are reported beside the forward's compulsory ones. --rounds R (> 1)
first runs the forward for --warm-s seconds (the GPU slows by a few % in its first seconds
under this load), then times every mode R times, each right after the first mode (none), and
reports the medians and each mode's median ratio to the first mode's timings before and after
it (*_paired).

    python3 bench/probes/checkpoints_probe.py [--iters N] [--out JSON] [--cases A,B] (of
        bench.CASES; default B1 T8192 H64 and varlen mix H64)
        [--modes "none,every 64 fp32"] [--rounds R]
    python3 bench/probes/checkpoints_probe.py --table JSON --out PREFIX   (.md and .png)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CASES = ("B1 T8192 H64", "varlen mix H64")
# name -> (dtype, every, first) for the slots form; "offsets 1024": the offsets form
MODES = ("none", "offsets 1024 fp32", "every 1024 fp32", "every 64 fp32", "every 64 bf16",
         "every 64 fp32 mid-chunk", "every 64 bf16 mid-chunk", "every 64 fp32 no first",
         "every 64 bf16 no first", "every 1024 fp32 mid-chunk")


def _imports():
    sys.path.insert(0, str(ROOT))
    if str(ROOT / "bench") not in sys.path:
        sys.path.append(str(ROOT / "bench"))
    import bench
    return bench


def lengths(x) -> list[int]:
    cu = x["cu_seqlens"]
    if cu is None:
        B, T = x["q"].shape[:2]
        return [T] * B
    return [int(b - a) for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]


def checkpoint_args(x, mode: str) -> tuple[dict, int]:
    """fwd's checkpoint arguments for `mode` and the bytes they write."""
    import torch

    if mode == "none":
        return {}, 0
    lens = lengths(x)
    N, H, V, K = len(lens), x["v"].shape[2], x["v"].shape[3], x["q"].shape[3]
    dev = x["q"].device
    if mode.startswith("offsets"):
        C = max(1, max(n // 1024 for n in lens))
        offs = torch.full((N, C), -1, dtype=torch.int32)
        used = 0
        for n, L in enumerate(lens):
            for c in range(L // 1024):
                offs[n, c] = 1024 * (c + 1)
                used += 1
        cs = torch.empty(N, C, H, V, K, dtype=torch.float32, device=dev)
        return {"checkpoint_state": cs, "checkpoint_offsets": offs.to(dev)}, used * H * V * K * 4
    dtype = torch.float32 if "fp32" in mode else torch.bfloat16
    every = int(mode.split()[1])  # "every N fp32|bf16 [mid-chunk]"
    first = every - 24 if "mid-chunk" in mode else every
    M = max(1, max((L - first) // every + 1 for L in lens))
    used = sum(max(0, (L - first) // every + 1) for L in lens)
    pool = torch.empty(N * M, H, V, K, dtype=dtype, device=dev)
    slots = torch.arange(N * M, dtype=torch.int32, device=dev).view(N, M)
    kw = {"checkpoint_state": pool, "checkpoint_slots": slots, "checkpoint_every": every}
    if "no first" not in mode:  # (without: the boundaries at every, 2 every, ... known aligned)
        kw["checkpoint_first"] = torch.full((N,), first, dtype=torch.int32, device=dev)
    return kw, used * H * V * K * dtype.itemsize


def give_workspace(sets: list, kws: list, precision: str = "fast") -> None:
    """One workspace for every input set, as large as the largest any of the checkpoint
    arguments `kws` need (x["ck_workspace"])."""
    import torch

    from kda_cute import api

    need = 0
    for kw in kws:
        x = sets[0]
        p = api.validate(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"],
                         x["A_log"], x["dt_bias"], x["lower_bound"], x["initial_state"],
                         x["final_state"], x["cu_seqlens"], "bounded", **kw)
        need = max(need, api.workspace_bytes(p, api.config_for(p, precision=precision)))
    for x in sets:
        x["ck_workspace"] = torch.empty(need, dtype=torch.uint8, device="cuda")


def runner(kw: dict, precision: str = "fast"):
    from kda_cute import fwd

    def run(x):
        fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"], x["A_log"],
            x["dt_bias"], x["lower_bound"], x["initial_state"], x["final_state"],
            x["cu_seqlens"], x["ck_workspace"], precision=precision, **kw)
    return run


def table(res: dict, prefix: str) -> None:
    lines = ["| case | mode | eager ms | vs none | graph ms | vs none | checkpoint MB | "
             "compulsory MB |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for row in res["rows"]:
        base = row["modes"]["none"]
        for mode, r in row["modes"].items():
            lines.append(f"| {row['case']} | {mode} | {r['eager']:.3f} | "
                         f"{r['eager'] / base['eager'] - 1:+.1%} | {r['graph']:.3f} | "
                         f"{r['graph'] / base['graph'] - 1:+.1%} | {r['bytes'] / 1e6:.0f} | "
                         f"{row['compulsory'] / 1e6:.0f} |")
    Path(prefix + ".md").write_text(
        "Checkpoint cost, ms (median of CUDA-event-timed calls, cold L2), K = V = 128, fast "
        "precision; `vs none`: against the same forward without checkpoints in the same run\n\n"
        + "\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(10, 4))
    rows = res["rows"]
    modes = list(rows[0]["modes"])
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        ax.bar([i + j * width - 0.4 for i in range(len(rows))],
               [r["modes"][mode]["graph"] for r in rows], width, label=mode)
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows])
    ax.set_ylabel("ms (CUDA graph)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(prefix + ".png", dpi=120)


def paired(base: list, times: list, i: int, per: int) -> float:
    """The median over rounds of a mode's time over the mean of the base timings either side
    of it: round j timed the base `per` times, the i-th of the other modes between base
    timings j per + i and j per + i + 1."""
    return statistics.median(t / ((base[j * per + i] + base[j * per + i + 1]) / 2)
                             for j, t in enumerate(times))


def _warm(fn, sets, seconds: float) -> None:
    """Run fn over the input sets for `seconds` of wall time: the GPU's clocks settle under
    load (an H200 runs a few % slower after some seconds of this work than at its start)."""
    import time

    import torch

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for x in sets:
            fn(x)
        torch.cuda.synchronize()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--out", default=None)
    ap.add_argument("--table", default=None)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of bench.CASES")
    ap.add_argument("--head-dim", type=int, default=128, help="K = V")
    ap.add_argument("--precision", choices=("fast", "precise"), default="fast")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated, of MODES")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every mode this many times, each right after the first mode "
                         "(each figure the median; *_paired: the median ratio to the first "
                         "mode's timings around it)")
    ap.add_argument("--warm-s", type=float, default=10.0,
                    help="with --rounds > 1: run the first mode this long before timing")
    a = ap.parse_args(argv)
    cases, modes = a.cases.split(","), a.modes.split(",")
    if a.table:
        table(json.loads(Path(a.table).read_text()), a.out)
        return
    bench = _imports()
    for flag, given, known in (("--cases", cases, tuple(bench.CASES)), ("--modes", modes, MODES)):
        for x in given:
            if x not in known:
                raise SystemExit(f"{flag}: expected some of {known}, got {x!r}")
    import torch

    rows = []
    for name in cases:
        sets = bench.input_sets(bench.CASES[name], a.head_dim, workspace=False)
        args = {m: checkpoint_args(sets[0], m) for m in modes}
        give_workspace(sets, [kw for kw, _ in args.values()], a.precision)
        row = {"case": name, "head_dim": a.head_dim, "precision": a.precision,
               "compulsory": bench.compulsory_bytes(sets[0]), "modes": {}}
        runs = {}
        for m in modes:
            run = runner(args[m][0], a.precision)
            runs[m] = (run, bench.graph_runner(run, sets))
            row["modes"][m] = {"bytes": args[m][1], "eager_rounds": [], "graph_rounds": []}
        if a.rounds > 1:
            _warm(runs[modes[0]][1], sets, a.warm_s)
        for _ in range(a.rounds):
            # each mode right after the first one (the forward without, where it is first):
            # its ratio to the mean of the first one's timings before and after it
            order = [modes[0]] + [x for m in modes[1:] for x in (m, modes[0])]
            for m in order:
                r = row["modes"][m]
                r["eager_rounds"].append(bench.time_fn(runs[m][0], sets, a.iters))
                r["graph_rounds"].append(bench.time_fn(runs[m][1], sets, a.iters))
                torch.cuda.synchronize()
                print(name, m, r["eager_rounds"][-1], r["graph_rounds"][-1], flush=True)
        for m in modes:
            r = row["modes"][m]
            r["eager"], r["graph"] = (statistics.median(r[k + "_rounds"])
                                      for k in ("eager", "graph"))
        base = row["modes"][modes[0]]
        for i, m in enumerate(modes[1:]):
            if a.rounds > 1:
                r = row["modes"][m]
                for k in ("eager", "graph"):
                    r[k + "_paired"] = paired(base[k + "_rounds"], r[k + "_rounds"], i,
                                              len(modes))
        for m in modes:
            r = row["modes"][m]
            print(name, m, json.dumps({k: r[k] for k in r if not k.endswith("_rounds")}),
                  flush=True)
        rows.append(row)
        del sets, args
        torch.cuda.empty_cache()
    res = {"versions": bench.versions(), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
