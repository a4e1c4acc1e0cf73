"""Benchmark: context parallelism's scaling (kda_cute.context, kda_cute.distributed) against the
one-GPU forward, one long sequence, K = V = 128, fp32 states, bounded gate.

    python bench/context.py --simulate [--tokens 131072,...] [--heads 12,32] [--out P]
    torchrun --nproc-per-node R bench/context.py --ranks [--out P]

--simulate (one GPU): the one-GPU forward of T tokens, and for R = 2, 4, 8 each rank's work
timed alone (its shard's summary, the entry's fold, its finish), each a CUDA graph, the forward
and the ranks taking turns over three rounds (each its median of them): a rank count's time is
its slowest rank's against the forward of its own turns, the exchange left out (measured by
--ranks); the crossover is the shortest T where 2 ranks beat 1. --ranks (R processes, one GPU
each, NCCL): the one-GPU forward on rank 0, then `kda_cute.distributed.fwd` on every rank, each
iteration after a barrier, a rank count's time its slowest rank's. Each figure is the median of
CUDA-event timings after warm-up (a prefill of this size far exceeds the L2: no flush).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import report  # noqa: E402

import kda_cute  # noqa: E402
from bench import graphed, pyplot, time_flushed, versions  # noqa: E402
from kda_cute.context import combine, context_finish, context_summary  # noqa: E402

K = 128
SCALE = K ** -0.5
LB = -5.0
TOKENS = (131072, 262144, 524288, 1048576)
CROSSOVER = (8192, 16384, 32768, 65536, 131072)


def _inputs(T, H, dev, seed=0):
    gen = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device=dev).to(torch.bfloat16)
    x = (rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H))
    gate = (torch.randn(H, generator=gen, device=dev) * 0.5,
            torch.randn(H * K, generator=gen, device=dev) * 0.5, LB)
    return x, gate


def _ms(fn, iters=5, warmup=2) -> float:
    """Median ms by CUDA events (no L2 flush: a prefill of this size far exceeds it)."""
    return time_flushed(fn, iters, lambda: None, warmup)


def _bounds(T, R):
    return [T * r // R // 64 * 64 for r in range(R)] + [T]


def one_gpu(x, gate, H):
    """The one-GPU forward of all the tokens, as a callable (warmed up)."""
    out = torch.empty_like(x[2])
    s0 = torch.zeros(1, H, K, K, device=x[0].device)
    s1 = torch.empty_like(s0)

    def run():
        kda_cute.fwd(*x, SCALE, out, *gate, s0, s1)
    run()
    return run


def rank_work(x, gate, H, a, b, first: bool, segments: int | None = None):
    """Rank work on tokens a..b as a callable (warmed up): its summary, the fold of one
    earlier message, its finish (`segments` a sequence: the plan's choice where None)."""
    dev = x[0].device
    sh = tuple(t[:, a:b] for t in x)
    A, B = torch.empty(1, H, K, K, device=dev), torch.empty(1, H, K, K, device=dev)
    out = torch.empty_like(sh[2])
    init, final = torch.zeros(1, H, K, K, device=dev), torch.empty(1, H, K, K, device=dev)
    ws = context_summary(*sh, SCALE, *gate, A, B, segments=segments)

    def run():
        context_summary(*sh, SCALE, *gate, A, B, workspace=ws, segments=segments)
        entry = init if first else combine(A, B, init[0])[None]
        context_finish(*sh, SCALE, out, *gate, entry, final, workspace=ws, segments=segments)
    run()
    return run


def _rounds(fns, rounds: int = 3) -> list[float]:
    """Each callable's median over `rounds` rounds of its median ms, the callables taking turns
    within a round (one GPU's clock, which a long run at the power cap lowers, then weighs on
    each alike)."""
    samples = [[] for _ in fns]
    for _ in range(rounds):
        for got, fn in zip(samples, fns, strict=True):
            got.append(_ms(fn))
    return [statistics.median(t) for t in samples]


def _ranks(x, gate, H, T, R, segments=None):
    """(one GPU ms, each rank's ms) for R ranks, each a CUDA graph (as an engine runs a layer:
    no host time), timed in turns."""
    bd = _bounds(T, R)
    fns = [graphed(one_gpu(x, gate, H))] + [
        graphed(rank_work(x, gate, H, bd[r], bd[r + 1], r == 0, segments)) for r in range(R)]
    t = _rounds(fns)
    del fns
    kda_cute.clear_caches()  # (the plans' cached workspaces: tens of GB at 1M tokens)
    torch.cuda.empty_cache()
    return t[0], t[1:]


def simulate(tokens, heads, counts=(), most: int = 1 << 62) -> list[dict]:
    """The rows; with `counts`, each rank count's time at each of those segments a shard too
    (by_segments); T H above `most` token-heads left out. The one-GPU time is the median over
    the rank counts' turns."""
    rows = []
    for H in heads:
        for T in sorted(set(tokens) | set(CROSSOVER)):
            if T * H > most:  # (the forward's and the ranks' workspaces held together)
                continue
            x, gate = _inputs(T, H, "cuda", seed=T + H)
            row = {"H": H, "T": T, "ranks": {}}
            bases = []
            for R in (2, 4, 8):
                base, per = _ranks(x, gate, H, T, R)
                bases.append(base)
                row["ranks"][str(R)] = {"rank_ms": per, "one_gpu_ms": base, "ms": max(per),
                                        "speedup": base / max(per)}
                if counts:  # (keys as the JSON holds them)
                    row["ranks"][str(R)]["by_segments"] = {
                        str(P): max(_ranks(x, gate, H, T, R, P)[1]) for P in counts}
            row["one_gpu_ms"] = statistics.median(bases)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del x
            torch.cuda.empty_cache()
    return rows


def distributed(tokens, heads) -> list[dict]:
    import torch.distributed as dist

    from kda_cute import distributed as kd
    rank, R = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    rows = []
    try:
        for H in heads:
            for T in tokens:
                x, gate = _inputs(T, H, dev, seed=T + H)
                base = _ms(one_gpu(x, gate, H)) if rank == 0 else 0.0
                bd = _bounds(T, R)
                sh = tuple(t[:, bd[rank]:bd[rank + 1]].contiguous() for t in x)
                del x
                out = torch.empty_like(sh[2])
                init = torch.zeros(1, H, K, K, device=dev)
                final = torch.empty_like(init)
                times = []
                for i in range(7):
                    dist.barrier()
                    torch.cuda.synchronize()
                    s = torch.cuda.Event(enable_timing=True)
                    e = torch.cuda.Event(enable_timing=True)
                    s.record()
                    kd.fwd(*sh, SCALE, out, *gate, init, final, carry_in=rank > 0)
                    e.record()
                    e.synchronize()
                    if i >= 2:
                        times.append(s.elapsed_time(e))
                mine = torch.tensor([statistics.median(times)], device=dev)
                every = [torch.empty_like(mine) for _ in range(R)]
                dist.all_gather(every, mine)
                if rank == 0:
                    slowest = max(float(t) for t in every)
                    rows.append({"H": H, "T": T, "ranks": R, "one_gpu_ms": base,
                                 "ms": slowest, "speedup": base / slowest,
                                 "rank_ms": [float(t) for t in every]})
                    print(json.dumps(rows[-1]), flush=True)
                del sh
                torch.cuda.empty_cache()
    finally:
        dist.destroy_process_group()
    return rows if rank == 0 else []


def markdown(data) -> str:
    """The simulation's or the ranks' table (report.py's, as docs/results.md shows it)."""
    return "\n".join(report.context_table(data)) + "\n"


def plot(data, path) -> None:
    """Speedup over one GPU against T, a line per (H, ranks)."""
    plt = pyplot()
    if plt is None or data.get("mode") == "ranks":
        return
    rows = data["rows"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for H in sorted({r["H"] for r in rows}):
        mine = sorted((r for r in rows if r["H"] == H), key=lambda r: r["T"])
        for R in sorted({int(R) for r in mine for R in r["ranks"]}):
            ax.plot([r["T"] for r in mine], [r["ranks"][str(R)]["speedup"] for r in mine],
                    marker="o", label=f"H {H}, {R} ranks")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens T")
    ax.set_ylabel("speedup over one GPU (slowest rank)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write(data, out: Path) -> None:
    """The JSON, its table (.md) and its plot (.png)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(data))
    plot(data, out.with_suffix(".png"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate", action="store_true", help="R ranks' work in turn on one GPU")
    ap.add_argument("--ranks", action="store_true", help="under torchrun: one rank a GPU")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--heads", default="12,32")
    ap.add_argument("--segments", default="",
                    help="--simulate: also each rank count at these segments a shard (1,2,4)")
    ap.add_argument("--most", type=int, default=1 << 62,
                    help="--simulate: leave out T x H above this many token-heads (memory)")
    ap.add_argument("--out", default="bench/results/context.json")
    ap.add_argument("--render", metavar="JSON", help="write the table and plot of a result")
    a = ap.parse_args(argv)
    if a.render:
        write(json.loads(Path(a.render).read_text()), Path(a.render))
        return
    tokens = [int(t) for t in a.tokens.split(",")]
    heads = [int(h) for h in a.heads.split(",")]
    if a.simulate == a.ranks:
        ap.error("one of --simulate or --ranks")
    counts = [int(c) for c in a.segments.split(",") if c]
    rows = simulate(tokens, heads, counts, a.most) if a.simulate else distributed(tokens, heads)
    if rows:
        write({"versions": versions(), "mode": "simulate" if a.simulate else "ranks",
               "rows": rows, "method": __doc__}, Path(a.out))


if __name__ == "__main__":
    main()
