"""What writing checkpoints costs a prefill: `fwd` with and without them, in one process.

    python3 bench/checkpoints.py [--cases "B1 T8192 H64,varlen mix H64"] [--rounds 5] [--out P]
    python3 bench/checkpoints.py --merge A.json B.json --out P   (two processes, one table)

Modes: none; one fp32 checkpoint per 1024 tokens, one per 64 (fp32, bf16), into a pool on chunk
ends (checkpoint_every, checkpoint_first = every). K = V = 128, fast precision, bench.py's
method (CUDA events and graphs, warm-up, median of --iters, cold L2). The clock drifts under
this load, so after --warm-s seconds of the forward each mode is timed between two timings
without checkpoints, --rounds times; `*_paired` is the median of its time over their mean.
Writes P.json (report.py's checkpoint table), P.md and P.png."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import (  # noqa: E402
    CASES,
    compulsory_bytes,
    graph_runner,
    input_sets,
    kda_runner,
    problem_of,
    pyplot,
    time_fn,
    versions,
)

MODES = ("none", "every 1024 fp32", "every 64 fp32", "every 64 bf16")
BARS = {"every 1024 fp32": 0.02, "every 64 fp32": 0.20, "every 64 bf16": 0.10}


def checkpoint_args(x, mode: str) -> tuple[dict, int]:
    """fwd's checkpoint arguments for `mode` (a pool of slots enough for every sequence's
    boundaries at every, 2 every, ...) and the bytes they write."""
    import torch

    if mode == "none":
        return {}, 0
    (B, T, H, K), V, cu, dev = x["q"].shape, x["v"].shape[3], x["cu_seqlens"], x["q"].device
    lens = [T] * B if cu is None else (cu[1:] - cu[:-1]).tolist()
    dtype = torch.float32 if mode.endswith("fp32") else torch.bfloat16
    every = int(mode.split()[1])
    per = [n // every for n in lens]
    M = max(1, max(per))
    pool = torch.empty(len(lens) * M, H, V, K, dtype=dtype, device=dev)
    kw = {"checkpoint_state": pool, "checkpoint_every": every,
          "checkpoint_slots": torch.arange(len(lens) * M, dtype=torch.int32,
                                           device=dev).view(len(lens), M),
          "checkpoint_first": torch.full((len(lens),), every, dtype=torch.int32, device=dev)}
    return kw, sum(per) * H * V * K * dtype.itemsize


def give_workspace(sets: list, kws: list) -> None:
    """One workspace a set, as large as the largest any mode needs (so no call allocates)."""
    import torch

    from kda_cute import api

    ps = [problem_of(sets[0], check_seqlens=False, **kw) for kw in kws]
    need = max(api.workspace_bytes(p, api.config_for(p)) for p in ps)
    for x in sets:
        x["workspace"] = torch.empty(need, dtype=torch.uint8, device=x["q"].device)


def measure(case: str, rounds: int, iters: int, warm_s: float) -> dict:
    import torch

    sets = input_sets(CASES[case], 128, workspace=False)
    row = {"case": case, "compulsory": compulsory_bytes(sets[0]), "modes": {}}
    runs, args = {}, {m: checkpoint_args(sets[0], m) for m in MODES}
    give_workspace(sets, [kw for kw, _ in args.values()])
    for m in MODES:
        kw, nbytes = args[m]
        run = kda_runner(**kw)
        runs[m] = (run, graph_runner(run, sets))
        row["modes"][m] = {"bytes": nbytes, "eager_rounds": [], "graph_rounds": []}
    end = time.monotonic() + warm_s
    while time.monotonic() < end:
        for x in sets:
            runs["none"][1](x)
        torch.cuda.synchronize()
    # each round: none, m1, none, m2, none, ...: every mode between two timings without
    order = ["none", *[x for m in MODES[1:] for x in (m, "none")]]
    for _ in range(rounds):
        for k, i in (("eager", 0), ("graph", 1)):
            ts = [time_fn(runs[m][i], sets, iters) for m in order]
            for m, t in zip(order, ts, strict=True):
                row["modes"][m][f"{k}_rounds"].append(t)
            for j, m in enumerate(MODES[1:]):
                row["modes"][m].setdefault(f"{k}_ratios", []).append(
                    ts[2 * j + 1] / ((ts[2 * j] + ts[2 * j + 2]) / 2))
    for m in MODES:
        r = row["modes"][m]
        for k in ("eager", "graph"):
            r[k] = statistics.median(r[f"{k}_rounds"])
            if m != "none":
                r[f"{k}_paired"] = statistics.median(r[f"{k}_ratios"])
        print(case, m, f"eager {r['eager']:.4f} graph {r['graph']:.4f}", flush=True)
    return row


def each(xs, fmt) -> str:
    return " / ".join(format(x, fmt) for x in xs)


def write(doc: dict, prefix: Path) -> None:
    prefix.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    runs = [{(r["case"], m): v for r in p["rows"] for m, v in r["modes"].items()}
            for p in doc["processes"]]
    lines = [f"# Checkpoint costs against the bars ({doc['versions']['device']}, commit "
             f"{doc['versions']['commit']})", "", doc["method"].splitlines()[0], "",
             "| case | mode | bar | graph ms | graph vs none, paired | eager vs none, paired "
             "| checkpoint MB | met |", "|---|---|---:|---|---|---|---:|---|"]
    for c, m in (k for k in runs[0] if k[1] in BARS):
        g, e = ([x[c, m][f"{w}_paired"] - 1 for x in runs] for w in ("graph", "eager"))
        worst = max(g + e)
        met = "yes" if worst <= BARS[m] else f"no ({worst:+.1%})"
        ms = each([x[c, m]["graph"] for x in runs], ".4f")
        lines.append(f"| {c} | {m} | <= {BARS[m]:.0%} | {ms} | {each(g, '+.1%')} | "
                     f"{each(e, '+.1%')} | {runs[0][c, m]['bytes'] / 1e6:.0f} | {met} |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if (plt := pyplot()) is None:
        return
    rows = doc["processes"][0]["rows"]
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(MODES)
    for j, m in enumerate(MODES):
        ax.bar([i + (j - len(MODES) / 2 + 0.5) * width for i in range(len(rows))],
               [r["modes"][m]["graph"] for r in rows], width, label=m)
    ax.set_xticks(range(len(rows)), [r["case"] for r in rows])
    ax.set_ylabel("ms (median, CUDA graphs)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(prefix.with_suffix(".png"), dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="B1 T8192 H64,varlen mix H64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--warm-s", type=float, default=8.0)
    ap.add_argument("--merge", nargs="+", metavar="JSON", default=None)
    ap.add_argument("--out", type=Path, default=Path("bench/results/checkpoints"))
    a = ap.parse_args(argv)
    if a.merge:
        docs = [json.loads(Path(p).read_text()) for p in a.merge]
        doc = {**docs[0], "processes": [p for d in docs for p in d["processes"]]}
        write(doc, a.out)
        return
    cases = a.cases.split(",")
    if any(c not in CASES for c in cases):
        raise SystemExit(f"--cases: expected names from {list(CASES)}, got {cases}")
    v = versions()
    doc = {"commit": v["commit"], "versions": v, "bars": BARS, "method": __doc__.strip(),
           "processes": [{"rows": [measure(c, a.rounds, a.iters, a.warm_s) for c in cases]}]}
    write(doc, a.out)


if __name__ == "__main__":
    main()
