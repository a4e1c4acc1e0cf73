"""Benchmark: the prefill forward against a state pool (state_indices) vs the dense forward, on
the H200, side by side in one run over bench.py's cases.

    python bench/pool_prefill.py [--quick] [--cases NAME,...] [--head-dims 128] [--out JSON]

Each case times the dense call (initial_state [N] in, final_state [N] out) and the pool form
(a fp32 pool of 4N slots, random int32 slots, updated in place) on the same input sets, cold L2
as bench.py (CUDA events, warm-up, median, sets rotated past 3x the L2), eager and in a CUDA
graph, in rounds of dense, pool, pool, dense (each figure the median of its rounds' medians,
--rounds of them: one run's medians drift by a few percent between rounds). Before
timing, the pool form's outputs and written slots are checked bit-identical to the dense
forward's on the same states. Writes JSON (device, versions, commit, every figure), a Markdown
table and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import zlib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench as b  # noqa: E402
from kda_cute import fwd  # noqa: E402


def with_pools(sets, seed: int):
    """Each input set gets a pool of 4N slots holding its initial states at random slots
    (`slots`), and `pool0`, the pool as made (the bit-identity check restores from it)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    for x in sets:
        s0 = x["initial_state"]
        N = s0.shape[0]
        pool = torch.randn(4 * N, *s0.shape[1:], generator=gen, device="cuda") * 0.3
        slots = torch.randperm(4 * N, generator=gen, device="cuda")[:N].to(torch.int32)
        pool[slots.long()] = s0.float()
        x.update(pool=pool, slots=slots, pool0=pool.clone())
    return sets


def dense(x):
    b.kda_runner()(x)


def pooled(x):
    fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"], x["A_log"],
        x["dt_bias"], x["lower_bound"], x["pool"], x["pool"], x["cu_seqlens"], x["workspace"],
        check_seqlens=False, state_indices=x["slots"])


def bit_identical(x) -> bool:
    """The pool form's outputs and written slots equal the dense forward's on the same states."""
    x["pool"].copy_(x["pool0"])
    x["out"].fill_(float("nan"))
    dense(x)
    torch.cuda.synchronize()
    d_out, d_final = x["out"].clone(), x["final_state"].clone()
    x["out"].fill_(float("nan"))
    pooled(x)
    torch.cuda.synchronize()
    same = (torch.equal(x["out"].view(torch.int16), d_out.view(torch.int16))
            and torch.equal(x["pool"][x["slots"].long()].view(torch.int32),
                            d_final.view(torch.int32)))
    x["pool"].copy_(x["pool0"])
    return bool(same)


def bench_case(name, spec, K, iters, rounds) -> dict:
    seed = zlib.crc32(name.encode()) % 1000
    sets = with_pools(b.input_sets(spec, K, seed, later_seed=0), seed)
    ok = bit_identical(sets[0])
    t = {"dense": [], "pool": [], "dense_graph": [], "pool_graph": []}
    for kind in ("dense", "pool", "pool", "dense") * rounds:
        fn = dense if kind == "dense" else pooled
        t[kind].append(b.time_fn(fn, sets, iters))
        t[kind + "_graph"].append(b.time_fn(b.graph_runner(fn, sets), sets, iters))
    row = {"case": name, "K": K, "N": sets[0]["N"], "bit_identical": ok,
           "input_sets": len(sets)}
    for k, v in t.items():
        row[k + "_ms"] = statistics.median(v)
        row[k + "_runs_ms"] = v
    finish(row)
    print(f"{name:<20} K{K} dense {row['dense_ms']:.4f} pool {row['pool_ms']:.4f} "
          f"({row['pool_over_dense']:.3f}x) graph {row['dense_graph_ms']:.4f} "
          f"{row['pool_graph_ms']:.4f} ({row['pool_over_dense_graph']:.3f}x) "
          f"bit-identical {ok}", flush=True)
    return row


def finish(row) -> dict:
    """The ratios of a row: of the medians, and of the fastest rounds (the least disturbed:
    a busy round slows a case by up to 15% on the H200's wide serial grids)."""
    for k in ("dense", "pool", "dense_graph", "pool_graph"):
        row[k + "_min_ms"] = min(row[k + "_runs_ms"])
    row["pool_over_dense"] = row["pool_ms"] / row["dense_ms"]
    row["pool_over_dense_graph"] = row["pool_graph_ms"] / row["dense_graph_ms"]
    row["pool_over_dense_min"] = row["pool_min_ms"] / row["dense_min_ms"]
    row["pool_over_dense_graph_min"] = row["pool_graph_min_ms"] / row["dense_graph_min_ms"]
    return row


def table(rows) -> str:
    lines = ["| case | K | dense ms | pool ms | pool / dense | dense graph ms | pool graph ms | "
             "pool / dense (graph) | fastest rounds: eager, graph | bit-identical |",
             "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['case']} | {r['K']} | {r['dense_ms']:.4f} | {r['pool_ms']:.4f} | "
                     f"{r['pool_over_dense']:.3f} | {r['dense_graph_ms']:.4f} | "
                     f"{r['pool_graph_ms']:.4f} | {r['pool_over_dense_graph']:.3f} | "
                     f"{r['pool_over_dense_min']:.3f}, {r['pool_over_dense_graph_min']:.3f} | "
                     f"{'yes' if r['bit_identical'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> None:
    plt = b.pyplot()
    if plt is None:
        return
    names = [f"{r['case']} K{r['K']}" for r in rows]
    fig, ax = plt.subplots(figsize=(10, 4))
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["pool_over_dense"] for r in rows], 0.4, label="eager")
    ax.bar([x + 0.2 for x in xs], [r["pool_over_dense_graph"] for r in rows], 0.4,
           label="CUDA graph")
    ax.axhline(1.03, color="red", linestyle="--", linewidth=1, label="+3%")
    ax.axhline(1.0, color="black", linewidth=0.5)
    ax.set_xticks(list(xs), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("pool-form time / dense time")
    ax.set_ylim(0.9, 1.1)
    ax.legend()
    ax.set_title("Prefill against a state pool vs dense states (H200)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="bench.py's quick cases")
    ap.add_argument("--cases", default="")
    ap.add_argument("--head-dims", default="128")
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "pool-prefill.json"))
    ap.add_argument("--render", metavar="JSON", default=None,
                    help="no timing: the table and plot of a result file, beside it")
    a = ap.parse_args(argv)
    if a.render:
        path = Path(a.render)
        rows = [finish(r) for r in json.loads(path.read_text())["rows"]]
        path.with_suffix(".md").write_text(table(rows))
        plot(rows, path.with_suffix(".png"))
        print(table(rows))
        return 0
    names = (a.cases.replace("_", " ").split(",") if a.cases
             else b.QUICK if a.quick else list(b.CASES))
    rows = [bench_case(n, b.CASES[n], int(K), a.iters, a.rounds) for K in a.head_dims.split(",")
            for n in names]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**b.versions(), "iters": a.iters, "rounds": a.rounds,
                               "rows": rows}, indent=1)
                   + "\n")
    out.with_suffix(".md").write_text(table(rows))
    plot(rows, out.with_suffix(".png"))
    print(table(rows))
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
