"""Benchmark: the replay calls (kda_cute.replay_decode / replay_verify) against today's
kda_cute.decode / verify (style a) and fla's Triton `fused_recurrent_kda_fwd`, side by side in
one run.

    python bench/replay.py [--quick] [--no-fla] [--out bench/results/replay-DEVICE-DATE.json]
    python bench/replay.py --long | --sweep [--out P]
    ncu --clock-control none -k regex:kda --csv --page raw \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum \\
        python bench/replay.py --ncu 256:32 > ncu.csv;  python bench/replay.py --bytes ncu.csv

K = V = 128, bounded gate with q/k L2 norm and beta's sigmoid in the kernel, pools of random
states (four times the rows' slots), random distinct slots. Decode at the issue's N:H shapes and
small batches, rings of 8 and 16 entries with a window of 8: each row's cursor random in the
window and each graph replay moving it, so a row folds once every 8 steps as in serving.
Verify of T = 2, 4, 8, 16 drafts a row from cursor 4 of a filled ring (a ring of 16 for T <= 8,
32 for 16) against style (a), which writes the state after every token into its slot. Each
figure is the median of CUDA-graph launches with the L2 flushed (a 256 MB write) before each.
Bytes: the compulsory ones of each form at the steady state (decode: the state read and
written, the tokens; replay: the checkpoint read, a fold's write once a window, the live
entries read (on average (window - 1) / 2), one entry written, the tokens; verify: the state
read, T states (style a) or T entries (replay) written, the entries read), against the measured
device-to-device copy bandwidth. `--ncu` runs each form a few times for Nsight Compute, whose
DRAM bytes `--bytes` turns into bytes a step beside the model's.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
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
WINDOW = 8
DECODE = [(64, 32), (256, 32), (1024, 32), (256, 12), (256, 96), (8, 32), (16, 32), (32, 32)]
VERIFY = [(N, T) for N in (64, 256) for T in (2, 4, 8, 16)]
LB = -5.0


def tokens_bytes(rows: int, H: int) -> int:
    """q, k, g, v, beta read and out written, bf16, for `rows` token rows."""
    return rows * H * (3 * K * 2 + 2 * V * 2 + 2)


def entry_bytes(u_bytes: int = 2) -> int:
    """A ring entry of one head: its key (bf16), running log-decay (fp32), inverse norm, u."""
    return 2 * K + 4 * K + 4 + u_bytes * V


def decode_bytes(N: int, H: int, es: int) -> int:
    return N * H * 2 * es * V * K + tokens_bytes(N, H)


def replay_bytes(N: int, H: int, es: int, window: int = WINDOW, u_bytes: int = 2) -> float:
    """A replay decode step at the steady state: the checkpoint read, a fold's write once a
    window, (window - 1) / 2 live entries read on average, an entry written on the steps that
    do not fold."""
    e = entry_bytes(u_bytes)
    per = es * V * K * (1 + 1 / window) + e * ((window - 1) / 2 + (window - 1) / window)
    return N * H * per + tokens_bytes(N, H)


def verify_bytes(N: int, T: int, H: int, es: int) -> int:
    """Style (a): the start state read, the state after each of T tokens written."""
    return N * H * (1 + T) * es * V * K + tokens_bytes(N * T, H)


def replay_verify_bytes(N: int, T: int, H: int, es: int, live: int, u_bytes: int = 2) -> int:
    """The checkpoint and `live` entries read, T entries written."""
    return N * H * (es * V * K + (live + T) * entry_bytes(u_bytes)) + tokens_bytes(N * T, H)


def _inputs(N, T, H, dtype, seed, slots=None):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)

    slots = slots or 4 * N
    x = dict(q=rnd(N, T, H, K), k=rnd(N, T, H, K), g=rnd(N, T, H, K), v=rnd(N, T, H, V),
             beta=rnd(N, T, H))
    gate = dict(A_log=torch.randn(H, generator=gen, device="cuda") * 0.5,
                dt_bias=torch.randn(H * K, generator=gen, device="cuda") * 0.5, lower_bound=LB)
    pool = torch.empty(slots, H, V, K, dtype=dtype, device="cuda").normal_(0, 0.3, generator=gen)
    return gen, x, gate, pool


def _filled_ring(pool, entries, gen, cursors_below):
    """A ring of random entries (log-decays falling 0.5 an entry), cursors random below
    `cursors_below`."""
    ring = kda_cute.new_ring(pool, entries)
    ring.ring_k.normal_(generator=gen)
    ring.ring_r.fill_(K ** -0.5)
    ring.ring_u.normal_(0, 0.1, generator=gen)
    ring.ring_g.copy_(torch.arange(1, entries + 1, device="cuda").view(1, 1, -1, 1) * -0.5)
    ring.cursor.copy_(torch.randint(0, cursors_below, ring.cursor.shape, generator=gen,
                                    device="cuda", dtype=torch.int32))
    return ring


def _tile(bound) -> str:
    return bound.plan.launches()[0].kernel.name.replace(f"kda_replay_k{K}_v{V}_", "").replace(
        f"kda_step_k{K}_v{V}_", "")


def decode_case(N, H, dtype, entries, fla, bw, iters, flush):
    gen, x, gate, pool = _inputs(N, 1, H, dtype, seed=N * 7 + H)
    idx = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:N].to(torch.int32)
    tok = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    out = torch.empty_like(x["v"])
    ckpt = pool.clone()
    ring = _filled_ring(ckpt, entries, gen, WINDOW)
    es = pool.element_size()
    row = {"form": "decode", "N": N, "H": H, "T": 1, "pool": str(dtype)[6:],
           "entries": entries, "window": WINDOW}
    # one step from the same states with an empty ring: replay and decode agree
    first = kda_cute.new_ring(ckpt, entries)
    c0 = ckpt.clone()
    o_r = kda_cute.replay_decode(*tok, c0, **first, state_indices=idx, window=WINDOW, **gate)
    o_d = kda_cute.decode(*tok, pool.clone(), idx, **gate)
    row["out_vs_decode"] = rel_err(o_r, o_d)

    def today(bind=False):
        return kda_cute.decode(*tok, pool, idx, out=out, bind=bind, **gate)

    def replay(bind=False):
        return kda_cute.replay_decode(*tok, ckpt, **ring, state_indices=idx, window=WINDOW,
                                      out=out, bind=bind, **gate)

    row["decode_tile"], row["replay_tile"] = _tile(today(True)), _tile(replay(True))
    row["decode_bytes"] = decode_bytes(N, H, es)
    row["replay_bytes"] = replay_bytes(N, H, es, WINDOW, ring.ring_u.element_size())
    row["decode_ms"] = time_flushed(graphed(today), iters, flush)
    row["replay_ms"] = time_flushed(graphed(replay), iters, flush)
    row["bytes_ratio"] = row["replay_bytes"] / row["decode_bytes"]
    row["time_ratio"] = row["replay_ms"] / row["decode_ms"]
    row["decode_pct"] = 100 * row["decode_bytes"] / bw * 1e3 / row["decode_ms"]
    row["replay_pct"] = 100 * row["replay_bytes"] / bw * 1e3 / row["replay_ms"]
    if fla is not None:
        fkw = dict(A_log=gate["A_log"], dt_bias=gate["dt_bias"], inplace_final_state=True,
                   state_v_first=True, ssm_state_indices=idx, use_qk_l2norm_in_kernel=True,
                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LB)

        def fl():
            fla(*tok, initial_state=pool, out=out, **fkw)
        row["fla_ms"] = time_flushed(graphed(fl), iters, flush)
        row["replay_vs_fla"] = row["fla_ms"] / row["replay_ms"]
    return row


def verify_case(N, T, H, dtype, bw, iters, flush):
    entries = 16 if T <= 8 else 32
    gen, x, gate, pool = _inputs(N, T, H, dtype, seed=N * 11 + T, slots=N * T + N)
    sidx = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:N * T].view(N, T).to(
        torch.int32).contiguous()
    idx = sidx[:, 0].contiguous()
    acc = torch.randint(1, T + 1, (N,), generator=gen, device="cuda", dtype=torch.int32)
    tok = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    out = torch.empty_like(x["v"])
    ckpt = pool.clone()
    ring = _filled_ring(ckpt, entries, gen, 1)
    live = 4
    ring.cursor.fill_(live)

    def today(bind=False):
        return kda_cute.verify(*tok, pool, ssm_state_indices=sidx, num_accepted_tokens=acc,
                               out=out, bind=bind, **gate)

    def replay(bind=False):
        return kda_cute.replay_verify(*tok, ckpt, **ring, state_indices=idx, out=out,
                                      bind=bind, **gate)

    es = pool.element_size()
    row = {"form": "verify", "N": N, "H": H, "T": T, "pool": str(dtype)[6:],
           "entries": entries, "live": live, "verify_tile": _tile(today(True)),
           "replay_tile": _tile(replay(True)),
           "verify_bytes": verify_bytes(N, T, H, es),
           "replay_bytes": replay_verify_bytes(N, T, H, es, live, ring.ring_u.element_size())}
    row["verify_ms"] = time_flushed(graphed(today), iters, flush)
    row["replay_ms"] = time_flushed(graphed(replay), iters, flush)
    row["speedup"] = row["verify_ms"] / row["replay_ms"]
    row["verify_pct"] = 100 * row["verify_bytes"] / bw * 1e3 / row["verify_ms"]
    row["replay_pct"] = 100 * row["replay_bytes"] / bw * 1e3 / row["replay_ms"]
    return row


def long_run(entries: int, window: int, N: int = 8, H: int = 4, steps: int = 4096,
             marks=(64, 512, 4096)) -> dict:
    """replay_decode over `steps` tokens (fp32 checkpoints) against the float64 token loop
    with its state in float64 beside it: the largest output error up to each mark, the
    checkpoint's after each fold, and the output error of each mark's own step."""
    from kda_cute.reference import preprocess
    gen, _, gate, pool = _inputs(N, 1, H, torch.float32, seed=N + steps, slots=2 * N)
    idx = torch.arange(N, dtype=torch.int32, device="cuda")
    ring = kda_cute.new_ring(pool, entries)
    S = pool[:N].double()
    worst_out, worst_state, marks_at = 0.0, 0.0, {}
    for t in range(steps):
        q, k, v, g = (torch.randn(N, 1, H, d, generator=gen, device="cuda").to(torch.bfloat16)
                      for d in (K, K, V, K))
        beta = torch.randn(N, 1, H, generator=gen, device="cuda").to(torch.bfloat16)
        o = kda_cute.replay_decode(q, k, v, g, beta, pool, **ring, state_indices=idx,
                                   window=window, **gate)
        qn, kn, a, b = preprocess(q, k, g, beta, A_log=gate["A_log"], dt_bias=gate["dt_bias"],
                                  lower_bound=LB)
        S = S * torch.exp(a[:, 0])[:, :, None, :]
        kt = kn[:, 0, :, :, None]
        err = v[:, 0].double() - (S @ kt).squeeze(-1)
        S = S + b[:, 0, :, None, None] * err[..., None] * kt.transpose(-1, -2)
        ref = K ** -0.5 * (S @ qn[:, 0, :, :, None]).squeeze(-1)
        e = rel_err(o[:, 0], ref)
        worst_out = max(worst_out, e)
        if t % window == window - 1:
            worst_state = max(worst_state, rel_err(pool[:N], S))
        if t + 1 in marks:
            marks_at[t + 1] = {"out_max": worst_out, "out_here": e, "state_max": worst_state}
    return {"entries": entries, "window": window, "N": N, "H": H, "steps": steps,
            "marks": marks_at}


def sweep(bw, iters, flush, forms=("decode", "verify")) -> list[dict]:
    """Every built replay decode and verify tile (step_ladder.REPLAY and REPLAY_VARIANTS)
    through the calls' config=, a CUDA graph each: decode at four N:H shapes (window 8, or the
    ring's where smaller), verify at VERIFY's N:T (H 32) where the tile holds T drafts past
    cursor 4."""
    from kda_cute.step_ladder import REPLAY, REPLAY_VARIANTS
    tiles = [c for c in REPLAY + REPLAY_VARIANTS if c.mode in forms]
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        pool_name = str(dtype)[6:]
        for N, H in ((64, 32), (256, 32), (1024, 32), (8, 32)):
            gen, x, gate, pool = _inputs(N, 1, H, dtype, seed=N * 3 + H)
            idx = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:N].to(
                torch.int32)
            tok = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            ms = {}
            for cfg in [c for c in tiles if c.mode == "decode" and c.pool == pool_name]:
                w = min(WINDOW, cfg.ring)
                ring = _filled_ring(pool, cfg.ring, gen, w)

                def run(cfg=cfg, ring=ring, w=w, tok=tok, pool=pool, idx=idx, gate=gate):
                    kda_cute.replay_decode(*tok, pool, **ring, state_indices=idx, window=w,
                                           config=cfg, **gate)
                ms[cfg.name] = time_flushed(graphed(run), iters, flush)
            rows.append({"form": "decode", "pool": pool_name, "N": N, "H": H, "T": 1,
                         "ms": ms})
            print(json.dumps(rows[-1]), flush=True)
        for N, T in VERIFY if "verify" in forms else ():
            gen, x, gate, pool = _inputs(N, T, 32, dtype, seed=N * 5 + T)
            idx = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:N].to(
                torch.int32)
            tok = (x["q"], x["k"], x["v"], x["g"], x["beta"])
            ms = {}
            for cfg in [c for c in tiles if c.mode == "verify" and c.pool == pool_name
                        and T <= (c.drafts or min(c.ring, 16)) and 4 + T <= c.ring]:
                ring = _filled_ring(pool, cfg.ring, gen, 1)
                ring.cursor.fill_(4)

                def run(cfg=cfg, ring=ring, tok=tok, pool=pool, idx=idx, gate=gate):
                    kda_cute.replay_verify(*tok, pool, **ring, state_indices=idx, config=cfg,
                                           **gate)
                ms[cfg.name] = time_flushed(graphed(run), iters, flush)
            rows.append({"form": "verify", "pool": pool_name, "N": N, "H": 32, "T": T,
                         "ms": ms})
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    return rows


def ncu_run(N: int, H: int, steps: int = 3) -> None:
    """Decode and the replay decode (ring 8, window 8) a few times each, eagerly, on fp32 and
    bf16 pools, for Nsight Compute."""
    for dtype in (torch.float32, torch.bfloat16):
        gen, x, gate, pool = _inputs(N, 1, H, dtype, seed=N + H)
        idx = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:N].to(torch.int32)
        tok = (x["q"], x["k"], x["v"], x["g"], x["beta"])
        ckpt = pool.clone()
        ring = _filled_ring(ckpt, 8, gen, WINDOW)
        for _ in range(steps):
            kda_cute.decode(*tok, pool, idx, **gate)
            kda_cute.replay_decode(*tok, ckpt, **ring, state_indices=idx, window=WINDOW, **gate)
    torch.cuda.synchronize()


def ncu_bytes(path: Path) -> dict:
    """Nsight Compute's raw CSV (--csv --page raw, dram__bytes_read.sum and
    dram__bytes_write.sum): each kernel's median DRAM bytes a launch."""
    rows = list(csv.DictReader(x for x in path.read_text().splitlines() if x.startswith('"')))
    by: dict[str, list[float]] = {}
    for r in rows:
        name = r.get("Kernel Name", "")
        try:
            rd = float(r["dram__bytes_read.sum"].replace(",", ""))
            wr = float(r["dram__bytes_write.sum"].replace(",", ""))
        except (KeyError, ValueError):
            continue  # the units row
        by.setdefault(name, []).append(rd + wr)
    return {n: statistics.median(v) for n, v in by.items()}


def markdown(rows, bw) -> str:
    lines = [f"Copy bandwidth {bw / 1e9:.0f} GB/s. K = V = {K}, CUDA graph, cold L2, median; "
             f"replay decode at a window of {WINDOW}.", "",
             "| form | pool | N | H | T | ring | today ms | replay ms | replay / today | "
             "bytes ratio | today % | replay % | fla ms | tiles |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        today = r.get("decode_ms", r.get("verify_ms"))
        tb = r.get("decode_bytes", r.get("verify_bytes"))
        pct = r.get("decode_pct", r.get("verify_pct"))
        tiles = f"{r.get('decode_tile', r.get('verify_tile'))} / {r['replay_tile']}"
        fla = f"{r['fla_ms']:.4f}" if "fla_ms" in r else "-"
        lines.append(f"| {r['form']} | {r['pool']} | {r['N']} | {r['H']} | {r['T']} | "
                     f"{r['entries']} | {today:.4f} | {r['replay_ms']:.4f} | "
                     f"{r['replay_ms'] / today:.2f} | {r['replay_bytes'] / tb:.2f} | "
                     f"{pct:.0f} | {r['replay_pct']:.0f} | {fla} | {tiles} |")
    return "\n".join(lines) + "\n"


def plot(rows, path):
    plt = pyplot()
    if plt is None:
        return
    names = [f"{r['form']} {r['pool']} N{r['N']} H{r['H']} T{r['T']} L{r['entries']}"
             for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(13, 0.28 * len(rows) + 2))
    y = list(range(len(rows)))
    a1.barh(y, [r["replay_ms"] / r.get("decode_ms", r.get("verify_ms")) for r in rows])
    a1.axvline(1.0, color="k", lw=0.8)
    a1.set_yticks(y, names, fontsize=7)
    a1.set_xlabel("replay time / today's (decode, or verify style a)")
    a2.barh([i + 0.2 for i in y], [r.get("decode_pct", r.get("verify_pct")) for r in rows],
            0.4, label="today")
    a2.barh([i - 0.2 for i in y], [r["replay_pct"] for r in rows], 0.4, label="replay")
    a2.set_yticks(y, [""] * len(rows))
    a2.set_xlim(0, 105)
    a2.set_xlabel("% of the copy ceiling on each form's bytes")
    a2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--out", default="bench/results/replay.json")
    ap.add_argument("--ncu", default="", help="N:H: run each form for Nsight Compute, no timing")
    ap.add_argument("--bytes", default="", help="an ncu CSV: DRAM bytes a launch by kernel")
    ap.add_argument("--sweep", action="store_true", help="every built replay tile through "
                    "config= instead of the table")
    ap.add_argument("--forms", default="decode,verify", help="the sweep's forms")
    ap.add_argument("--long", action="store_true", help="the long runs (4,096 steps against "
                    "float64) at rings of 8 and 16 entries, window 8, instead of the table")
    a = ap.parse_args(argv)
    if a.bytes:
        print(json.dumps(ncu_bytes(Path(a.bytes)), indent=1))
        return
    if a.ncu:
        ncu_run(*map(int, a.ncu.split(":")))
        return
    if a.long:
        res = {"versions": versions(), "long": [long_run(n, WINDOW) for n in (8, 16)]}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res["long"], indent=1))
        return
    fla = None if a.no_fla else fla_recurrent()
    bw = copy_bandwidth()
    flush = flusher()
    if a.sweep:
        res = {"versions": versions(), "copy_bandwidth": bw, "sweep": sweep(bw, a.iters, flush,
                                                                    a.forms.split(","))}
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
        return
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for N, H in DECODE[1:2] if a.quick else DECODE:
            for entries in (8, 16):
                rows.append(decode_case(N, H, dtype, entries, fla, bw, a.iters, flush))
                print(json.dumps(rows[-1]), flush=True)
                torch.cuda.empty_cache()
        for N, T in VERIFY[-3:-1] if a.quick else VERIFY:
            rows.append(verify_case(N, T, 32, dtype, bw, a.iters, flush))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"versions": versions(), "copy_bandwidth": bw, "rows": rows, "method": __doc__}
    out.write_text(json.dumps(res, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows, bw))
    plot(rows, out.with_suffix(".png"))
    print(markdown(rows, bw))


if __name__ == "__main__":
    main()
