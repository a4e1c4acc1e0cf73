"""Benchmark: kda_cute's decode and verify against a state pool vs fla's Triton
`fused_recurrent_kda_fwd`, side by side in one run on the H200.

    python bench/serving.py [--quick] [--out bench/results/serving-h200-DATE.json]
    python bench/serving.py --sweep [--verify] [--head-dim 64|128|256] [--match ..] [--shapes ..]

K = V = 128 (the tile sweep: --head-dim), bounded gate with q/k L2 norm and beta's sigmoid in the
kernel, fp32 and bf16 pools four times larger than the slots a call touches, random slots. Each
figure is the median of CUDA-event-timed launches, eager and replayed from a CUDA graph, with the
L2 flushed (a 256 MB write) before every launch. The ceiling is the compulsory bytes (touched
slots read and written, q, k, v, g, beta, out) at the measured device-to-device copy bandwidth.
Outputs are checked against each other (kda_cute vs fla) on the first set. Also reported: the
host time of an eager decode call and of a bound one (kda_cute.Bound).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import kda_cute  # noqa: E402
from bench import (  # noqa: E402
    copy_bandwidth,
    fla_recurrent,
    flusher,
    graphed,
    pyplot,
    time_flushed,
    versions,
)
from kda_cute.reference import rel_err  # noqa: E402

K = V = 128
DECODE_N = (1, 8, 64, 256, 1024)
DECODE_H = (12, 32, 96)
VERIFY = [(N, T) for N in (64, 256) for T in (2, 4, 8)]
def inputs(N, T, H, dtype, seed):
    """Tokens [N, T, H, *], a pool of 4 N T slots (random values), random distinct slots."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    slots = 4 * N * T

    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)

    x = dict(q=rnd(N, T, H, K), k=rnd(N, T, H, K), g=rnd(N, T, H, K), v=rnd(N, T, H, V),
             beta=rnd(N, T, H), A_log=torch.randn(H, generator=gen, device="cuda") * 0.5,
             dt_bias=torch.randn(H * K, generator=gen, device="cuda") * 0.5)
    pool = torch.empty(slots, H, V, K, dtype=dtype, device="cuda")
    pool.normal_(0, 0.3, generator=gen)
    x["pool"] = pool
    x["idx"] = torch.randperm(slots, generator=gen, device="cuda")[:N * T].view(N, T).to(
        torch.int32).contiguous()
    x["out"] = torch.empty_like(x["v"])
    return x


def tokens_bytes(N, T, H) -> int:
    return N * T * H * (3 * K * 2 + 2 * V * 2 + 2)


def step_bytes(N, T, H, state_bytes) -> int:
    """A step's compulsory bytes, N rows of T tokens: each row's start state read and its state
    after every token written (elements of `state_bytes`), and the tokens' (decode: T = 1)."""
    return (1 + T) * N * H * V * K * state_bytes + tokens_bytes(N, T, H)


def _plan_tile(bound) -> str:
    """The token-step tile a bound call's plan launches (its name without the head dims)."""
    return _short(bound.plan.launches()[0].kernel.name)


def decode_case(N, H, dtype, fla, bw, iters, flush):
    x = inputs(N, 1, H, dtype, seed=N * 7 + H)
    idx = x["idx"][:, 0].contiguous()
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, gate="bounded")
    pool0 = x["pool"].clone() if N * H <= 256 * 32 else None

    def kda(bind=False):
        return kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"], idx,
                               out=x["out"], bind=bind, **kw)

    row = {"form": "decode", "N": N, "H": H, "T": 1,
           "pool": str(dtype).replace("torch.", "")}
    row["tile"] = _plan_tile(kda(bind=True))
    esz = x["pool"].element_size()
    row["bytes"] = step_bytes(N, 1, H, esz)
    row["ceiling_ms"] = row["bytes"] / bw * 1e3
    row["kda_ms"] = time_flushed(kda, iters, flush)
    row["kda_graph_ms"] = time_flushed(graphed(kda), iters, flush)
    row["kda_pct"] = 100 * row["ceiling_ms"] / row["kda_graph_ms"]
    if fla is not None:
        tok = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        fkw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], inplace_final_state=True,
                   state_v_first=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)

        def fl():
            fla(*tok, initial_state=x["pool"], out=x["out"], **fkw)
        if pool0 is not None:  # one step of each from the same pool: the outputs agree
            p = pool0.clone()
            o1 = kda_cute.decode(*tok, p, idx, **kw)
            p2 = pool0.clone()
            o2, _ = fla(*tok, initial_state=p2, **fkw)
            row["out_vs_fla"] = rel_err(o1, o2)
            row["state_vs_fla"] = rel_err(p[idx.long()], p2[idx.long()])
        row["fla_ms"] = time_flushed(fl, iters, flush)
        row["fla_graph_ms"] = time_flushed(graphed(fl), iters, flush)
        row["fla_pct"] = 100 * row["ceiling_ms"] / row["fla_graph_ms"]
        row["speedup_vs_fla"] = row["fla_graph_ms"] / row["kda_graph_ms"]
        row["speedup_vs_fla_eager"] = row["fla_ms"] / row["kda_ms"]
    return row


def verify_case(N, T, H, dtype, fla, bw, iters, flush):
    x = inputs(N, T, H, dtype, seed=N * 11 + T)
    acc = torch.randint(1, T + 1, (N,), device="cuda", dtype=torch.int32)
    kw = dict(A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0, gate="bounded")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])

    def kda_a(bind=False):
        return kda_cute.verify(*args, x["pool"], ssm_state_indices=x["idx"],
                               num_accepted_tokens=acc, out=x["out"], bind=bind, **kw)

    sidx = x["idx"][:, 0].contiguous()
    inter = torch.empty(N, T, H, V, K, dtype=dtype, device="cuda")

    def kda_b():
        kda_cute.verify(*args, x["pool"], state_indices=sidx, intermediate_states=inter,
                        out=x["out"], **kw)

    esz = x["pool"].element_size()
    row = {"form": "verify", "N": N, "H": H, "T": T, "pool": str(dtype).replace("torch.", "")}
    row["tile"] = _plan_tile(kda_a(bind=True))
    row["bytes"] = step_bytes(N, T, H, esz)
    row["ceiling_ms"] = row["bytes"] / bw * 1e3
    row["kda_ms"] = time_flushed(kda_a, iters, flush)
    row["kda_graph_ms"] = time_flushed(graphed(kda_a), iters, flush)
    row["kda_pct"] = 100 * row["ceiling_ms"] / row["kda_graph_ms"]
    row["kda_scratch_graph_ms"] = time_flushed(graphed(kda_b), iters, flush)
    row["scratch_vs_slots"] = row["kda_scratch_graph_ms"] / row["kda_graph_ms"]
    if fla is not None:
        def fl():
            fla(*args, A_log=x["A_log"], dt_bias=x["dt_bias"], initial_state=x["pool"],
                inplace_final_state=True, state_v_first=True, ssm_state_indices=x["idx"],
                num_accepted_tokens=acc, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                use_beta_sigmoid_in_kernel=True, lower_bound=-5.0, out=x["out"])
        row["fla_ms"] = time_flushed(fl, iters, flush)
        row["fla_graph_ms"] = time_flushed(graphed(fl), iters, flush)
        row["fla_pct"] = 100 * row["ceiling_ms"] / row["fla_graph_ms"]
        row["speedup_vs_fla"] = row["fla_graph_ms"] / row["kda_graph_ms"]
    return row


SWEEP = [(1, 12), (8, 32), (64, 32), (256, 32), (1024, 32)]  # decode, N:H
VERIFY_SWEEP = [(64, 2), (64, 8), (256, 4), (256, 8)]  # verify, N:T at H 32


def sweep(bw, iters, flush, verify=False, match=(), pools=("float32", "bfloat16"), shapes=None
          ) -> list[dict]:
    """Every built step tile of K (128, or --head-dim) timed as a CUDA graph: decode at N:H
    shapes (step_ladder.STEP, STEP_SINGLE and STEP_VARIANTS), or with `verify` a verify (style (a),
    every token accepted) at N:T shapes and H 32 with the tiles that run multi-token steps (not
    the persistent ones but chunked; a chunked tile at the shapes of up to its chunk); only the
    tiles whose name holds one of `match`, when given."""
    from kda_cute.step_ladder import step_tiles
    rows = []
    for dtype in (getattr(torch, p) for p in pools):
        pool = "float32" if dtype == torch.float32 else "bfloat16"
        cfgs = [c for c in step_tiles() if c.head_dim_k == K and c.pool == pool
                and (not verify or not c.persist or c.chunk)
                and (not match or any(m in c.name for m in match))]
        for a, b in shapes or (VERIFY_SWEEP if verify else SWEEP):
            N, T, H = (a, b, 32) if verify else (a, 1, b)
            x = inputs(N, T, H, dtype, seed=9 if verify else 5)
            idx = x["idx"][:, 0].contiguous()
            acc = torch.full((N,), T, device="cuda", dtype=torch.int32)
            by = {}
            for c in cfgs:
                if c.chunk and c.chunk < T:  # a chunked tile takes rows of up to its chunk
                    continue

                def fn(c=c, x=x, idx=idx, acc=acc):
                    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"])
                    kw = dict(out=x["out"], A_log=x["A_log"], dt_bias=x["dt_bias"],
                              lower_bound=-5.0, config=c)
                    if verify:
                        kda_cute.verify(*args, ssm_state_indices=x["idx"],
                                        num_accepted_tokens=acc, **kw)
                    else:
                        kda_cute.decode(*args, idx, **kw)
                try:
                    by[c.name] = time_flushed(graphed(fn), iters, flush)
                except kda_cute.cubin.CubinsMissing:  # a tile not built in this cubin set
                    continue
            ceiling = step_bytes(N, T, H, x["pool"].element_size()) / bw * 1e3
            rows.append({"form": "verify" if verify else "decode", "N": N, "H": H, "T": T,
                         "pool": pool, "ceiling_ms": ceiling, "ms": by})
            print(json.dumps(rows[-1]), flush=True)
            x = idx = acc = None
            torch.cuda.empty_cache()
    return rows


def host_times(n_calls=300) -> dict:
    """Host time per call (us) of an eager decode, of the same with the repeat path off (every
    call through launch.run's checks and lookups), and of a bound one (N 1, H 12, fp32: the GPU
    work is shorter than the host's, and 300 calls stay within the launch queue)."""
    x = inputs(1, 1, 12, torch.float32, seed=3)
    idx = x["idx"][:, 0].contiguous()
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["pool"], idx)
    kw = dict(out=x["out"], A_log=x["A_log"], dt_bias=x["dt_bias"], lower_bound=-5.0)
    bound = kda_cute.decode(*args, bind=True, **kw)

    def full():
        again, kda_cute.launch.again = kda_cute.launch.again, lambda *a: False
        try:
            kda_cute.decode(*args, **kw)
        finally:
            kda_cute.launch.again = again

    res = {}
    for name, fn in (("eager_us", lambda: kda_cute.decode(*args, **kw)), ("bound_us", bound),
                     ("eager_full_us", full)):
        rounds = []
        for _ in range(7):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(n_calls):
                fn()
            rounds.append((time.perf_counter() - t0) / n_calls * 1e6)
            torch.cuda.synchronize()
        res[name] = min(rounds)
        res[name + "_rounds"] = rounds
    return res


def markdown(rows, host, bw) -> str:
    full = (f" (every call through the full launch path: {host['eager_full_us']:.1f} us)"
            if "eager_full_us" in host else "")
    lines = [f"Copy bandwidth {bw / 1e9:.0f} GB/s. Host time per decode call: eager "
             f"{host['eager_us']:.1f} us{full}, bound {host['bound_us']:.1f} us.", "",
             "| form | pool | N | H | T | kda graph ms | kda eager ms | % of ceiling | "
             "fla graph ms | fla % | vs fla (graph) | vs fla (eager) | scratch / slots | tile |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        def f(k, fmt="{:.4f}", r=r):
            return fmt.format(r[k]) if k in r else "-"
        lines.append(f"| {r['form']} | {r['pool']} | {r['N']} | {r['H']} | {r['T']} | "
                     f"{f('kda_graph_ms')} | {f('kda_ms')} | {f('kda_pct', '{:.0f}')} | "
                     f"{f('fla_graph_ms')} | {f('fla_pct', '{:.0f}')} | "
                     f"{f('speedup_vs_fla', '{:.2f}')} | {f('speedup_vs_fla_eager', '{:.2f}')}"
                     f" | {f('scratch_vs_slots', '{:.3f}')} | {r.get('tile', '-')} |")
    return "\n".join(lines) + "\n"


def _short(name: str) -> str:
    """A token-step tile's name without its head dims (those of the run: K = V)."""
    return name.replace(f"kda_step_k{K}_v{V}_", "")


def sweep_markdown(res) -> str:
    """A sweep (--sweep) as a table: each shape's tiles fastest first, with the ms, the % of
    the copy ceiling on compulsory bytes and the time over the shape's fastest."""
    lines = [f"Copy bandwidth {res['copy_bandwidth'] / 1e9:.0f} GB/s. K = V = {K}, CUDA graph, "
             "cold L2, median.", "",
             "| form | pool | N | H | T | tile | ms | % of ceiling | / fastest |",
             "|---|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in res["sweep"]:
        if not r["ms"]:
            continue
        best = min(r["ms"].values())
        for name, ms in sorted(r["ms"].items(), key=lambda x: x[1]):
            lines.append(f"| {r['form']} | {r['pool']} | {r['N']} | {r['H']} | {r['T']} | "
                         f"{_short(name)} | {ms:.4f} | "
                         f"{100 * r['ceiling_ms'] / ms:.1f} | {ms / best:.3f} |")
    return "\n".join(lines) + "\n"


def sweep_plot(res, path):
    """A sweep's % of the copy ceiling, a panel a shape, a bar a tile (fastest on top)."""
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in res["sweep"] if r["ms"]]
    if not rows:
        return
    most = max(len(r["ms"]) for r in rows)
    fig, axes = plt.subplots(len(rows), 1, figsize=(9, (0.22 * most + 0.6) * len(rows)),
                             squeeze=False)
    for ax, r in zip(axes[:, 0], rows, strict=True):
        tiles = sorted(r["ms"].items(), key=lambda x: -x[1])
        ax.barh(range(len(tiles)), [100 * r["ceiling_ms"] / ms for _, ms in tiles])
        ax.set_yticks(range(len(tiles)), [_short(n) for n, _ in tiles], fontsize=6)
        ax.set_xlim(0, 100)
        ax.set_title(f"{r['form']} {r['pool']} N{r['N']} H{r['H']} T{r['T']}", fontsize=8)
    axes[-1, 0].set_xlabel("% of the copy ceiling on compulsory bytes (CUDA graph, cold L2)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    names = [f"{r['form']} {r['pool']} N{r['N']} H{r['H']} T{r['T']}" for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(14, 0.3 * len(rows) + 2))
    y = list(range(len(rows)))
    a1.barh([i + 0.2 for i in y], [r["kda_graph_ms"] for r in rows], 0.4, label="kda_cute")
    if all("fla_graph_ms" in r for r in rows):
        a1.barh([i - 0.2 for i in y], [r["fla_graph_ms"] for r in rows], 0.4,
                label="fla fused_recurrent")
    a1.set_xscale("log")
    a1.set_yticks(y, names, fontsize=7)
    a1.set_xlabel("ms (median, CUDA graph, cold L2)")
    a1.legend()
    a2.barh([i + 0.2 for i in y], [r["kda_pct"] for r in rows], 0.4, label="kda_cute")
    if all("fla_pct" in r for r in rows):
        a2.barh([i - 0.2 for i in y], [r["fla_pct"] for r in rows], 0.4, label="fla")
    a2.set_yticks(y, [""] * len(rows))
    a2.set_xlabel("% of the copy ceiling on compulsory bytes")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--out", default="bench/results/serving.json")
    ap.add_argument("--sweep", action="store_true", help="only the tile sweep")
    ap.add_argument("--match", default="", help="the sweep: only tiles whose name holds one of "
                    "these comma-separated parts")
    ap.add_argument("--pools", default="float32,bfloat16", help="the sweep's pool dtypes")
    ap.add_argument("--shapes", default="", help="the sweep's N:H shapes, comma-separated "
                    "(default: SWEEP)")
    ap.add_argument("--verify", action="store_true", help="the sweep: verify (N:T shapes at "
                    "H 32, default VERIFY_SWEEP) instead of decode")
    ap.add_argument("--head-dim", type=int, default=128, choices=(64, 128, 256),
                    help="K = V of the tile sweep (the table is at 128)")
    a = ap.parse_args(argv)
    if a.head_dim != 128 and not a.sweep:
        raise SystemExit("--head-dim: the tile sweep's (--sweep); the table is at K = V = 128")
    global K, V
    K = V = a.head_dim
    fla = None if a.no_fla else fla_recurrent()
    bw = copy_bandwidth()
    flush = flusher()
    if a.sweep:
        shapes = [tuple(map(int, x.split(":"))) for x in a.shapes.split(",") if x]
        res = {"versions": versions(), "copy_bandwidth": bw, "head_dim": K, "sweep": sweep(
            bw, a.iters, flush, a.verify, tuple(m for m in a.match.split(",") if m),
            tuple(a.pools.split(",")), shapes), "host": host_times()}
        out = Path(a.out)
        out.write_text(json.dumps(res, indent=1) + "\n")
        out.with_suffix(".md").write_text(sweep_markdown(res))
        sweep_plot(res, out.with_suffix(".png"))
        print(json.dumps(res["host"]))
        return
    rows = []
    ns = (8, 256, 1024) if a.quick else DECODE_N
    hs = (32,) if a.quick else DECODE_H
    for dtype in (torch.float32, torch.bfloat16):
        for N in ns:
            for H in hs:
                rows.append(decode_case(N, H, dtype, fla, bw, a.iters, flush))
                print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache()
    for dtype in (torch.float32, torch.bfloat16):
        for N, T in (VERIFY[:1] + VERIFY[-2:] if a.quick else VERIFY):
            rows.append(verify_case(N, T, 32, dtype, fla, bw, a.iters, flush))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    host = host_times()
    print(json.dumps(host), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"versions": versions(), "copy_bandwidth": bw, "host": host, "rows": rows,
           "method": __doc__}
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, host, bw))
    plot(rows, out.with_suffix(".png"))
    print(markdown(rows, host, bw))


if __name__ == "__main__":
    main()
