"""Probe (issue 59): does a replay decode step, reading its checkpoint once and a short ring,
beat today's read-and-write step by the bytes it saves? A Triton model of the step, checked
against kda_cute.decode over steps with folds, then timed beside it (CUDA graphs, cold L2).

    python3 bench/probes/replay_probe.py [--quick] [--out P]

The step for a row (slot s, head h), the ring holding c < L entries since the checkpoint S_c:
- the gate a_t, G_t = G_(c-1) + a_t (the window's running log-decay, fp32 a channel);
- the window's keys w_j = k_j r_j exp(G_t - G_j) (k_j raw bf16, r_j its fp32 inverse norm);
- pred = S_c (e^G_t k_t) + sum_j u_j (w_j . k_t), u_t = beta (v_t - pred);
- o_t = S_c (e^G_t q_t) + sum_j u_j (w_j . q_t) + u_t (k_t . q_t);
- append (k_t, r_t, u_t, G_t) at c; at c = L - 1 write S_t (S_c e^G_t + sum u_j w_j^T + u_t k_t^T)
  as the new checkpoint instead (the ring restarts empty).
Each program takes BV rows of one head's state, so every row's prediction, u and fold are its
own; the cursor is read from one tensor and the next written to another (the step reads no
value it writes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from serving import _flusher, graphed, time_ms  # noqa: E402

import kda_cute  # noqa: E402
from bench import copy_bandwidth  # noqa: E402

K = V = 128
LB = -5.0


@triton.jit
def _row(q, k, v, g, beta, A_log, dt_bias, out, idx, cur_in, cur_out, pool, rk, rr_ptr, ru, rg,
         H, scale, lb, vb, h, n, L: tl.constexpr, LP: tl.constexpr, K: tl.constexpr,
         V: tl.constexpr, BV: tl.constexpr, MATH: tl.constexpr):
    s = tl.load(idx + n).to(tl.int64)
    c = tl.load(cur_in + s)
    ck = tl.arange(0, K)
    cv = vb * BV + tl.arange(0, BV)
    tok = (n * H + h)
    qv = tl.load(q + tok * K + ck).to(tl.float32)
    kv = tl.load(k + tok * K + ck).to(tl.float32)
    gv = tl.load(g + tok * K + ck).to(tl.float32)
    vv = tl.load(v + tok * V + cv).to(tl.float32)
    bt = tl.sigmoid(tl.load(beta + tok).to(tl.float32))
    al = tl.exp(tl.load(A_log + h))
    a = lb * tl.sigmoid(al * (gv + tl.load(dt_bias + h * K + ck)))
    rq = 1.0 / tl.sqrt(tl.sum(qv * qv) + 1e-6)
    rkt = 1.0 / tl.sqrt(tl.sum(kv * kv) + 1e-6)
    qn = qv * rq * scale
    kn = kv * rkt
    ring = (s * H + h) * L
    gprev = tl.load(rg + (ring + c - 1) * K + ck, mask=(ck < K) & (c > 0), other=0.0)
    gt = gprev + a
    eg = tl.exp(gt)
    S = tl.load(pool + ((s * H + h) * V + cv[:, None]) * K + ck[None, :]).to(tl.float32)
    pred = tl.sum(S * (eg * kn)[None, :], 1)
    o = tl.sum(S * (eg * qn)[None, :], 1)
    jj = tl.arange(0, LP)
    live = jj < c
    Kr = tl.load(rk + (ring + jj)[:, None] * K + ck[None, :], mask=live[:, None],
                 other=0.0).to(tl.float32)
    Gr = tl.load(rg + (ring + jj)[:, None] * K + ck[None, :], mask=live[:, None], other=0.0)
    rr = tl.load(rr_ptr + ring + jj, mask=live, other=0.0)
    U = tl.load(ru + (ring + jj)[:, None] * V + cv[None, :], mask=live[:, None],
                other=0.0).to(tl.float32)
    if MATH:
        W = Kr * rr[:, None] * tl.exp(gt[None, :] - Gr)
        pred += tl.sum(U * tl.sum(W * kn[None, :], 1)[:, None], 0)
        o += tl.sum(U * tl.sum(W * qn[None, :], 1)[:, None], 0)
    else:  # the same loads and stores, a token of arithmetic on each
        W = Kr * rr[:, None] + Gr
        pred += tl.sum(U, 0) + tl.sum(tl.sum(W, 1), 0)
    u = bt * (vv - pred)
    o += u * tl.sum(kn * qn)
    tl.store(out + tok * V + cv, o.to(out.dtype.element_ty))
    if c == L - 1:  # the ring is full with this token: S_t is the new checkpoint
        acc = S * eg[None, :] + u[:, None] * kn[None, :]
        acc += tl.dot(tl.trans(U), W, input_precision="ieee")
        tl.store(pool + ((s * H + h) * V + cv[:, None]) * K + ck[None, :],
                 acc.to(pool.dtype.element_ty))
        if (vb == 0) & (h == 0):
            tl.store(cur_out + s, 0)
    else:
        tl.store(ru + (ring + c) * V + cv, u.to(ru.dtype.element_ty))
        if vb == 0:
            tl.store(rk + (ring + c) * K + ck, kv.to(rk.dtype.element_ty))
            tl.store(rg + (ring + c) * K + ck, gt)
            tl.store(rr_ptr + ring + c, rkt)
            if h == 0:
                tl.store(cur_out + s, c + 1)


@triton.jit
def _replay_step(q, k, v, g, beta, A_log, dt_bias, out, idx, cur_in, cur_out, pool,
                 rk, rr_ptr, ru, rg, H, scale, lb, L: tl.constexpr, LP: tl.constexpr,
                 K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, MATH: tl.constexpr):
    _row(q, k, v, g, beta, A_log, dt_bias, out, idx, cur_in, cur_out, pool, rk, rr_ptr, ru, rg,
         H, scale, lb, tl.program_id(0), tl.program_id(1), tl.program_id(2), L, LP, K, V, BV,
         MATH)


@triton.jit
def _replay_persistent(q, k, v, g, beta, A_log, dt_bias, out, idx, cur_in, cur_out, pool,
                       rk, rr_ptr, ru, rg, H, N, scale, lb, L: tl.constexpr, LP: tl.constexpr,
                       K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, MATH: tl.constexpr,
                       STAGES: tl.constexpr):
    nvb = V // BV
    total = N * H * nvb
    for it in tl.range(tl.program_id(0), total, tl.num_programs(0), num_stages=STAGES):
        vb = it % nvb
        h = (it // nvb) % H
        n = it // (nvb * H)
        _row(q, k, v, g, beta, A_log, dt_bias, out, idx, cur_in, cur_out, pool, rk, rr_ptr, ru,
             rg, H, scale, lb, vb, h, n, L, LP, K, V, BV, MATH)


class Ring:
    """A checkpoint pool and its rings: k [slots, H, L, K] bf16, r [slots, H, L] fp32, u
    [slots, H, L, V] (fp16 or fp32), G [slots, H, L, K] fp32, cursors [slots] int32 (two: one
    read, one written)."""

    def __init__(self, pool, L, u_dtype=torch.float16):
        slots, H = pool.shape[:2]
        d = pool.device
        self.pool, self.L, self.H = pool, L, H
        self.k = torch.zeros(slots, H, L, K, dtype=torch.bfloat16, device=d)
        self.r = torch.zeros(slots, H, L, dtype=torch.float32, device=d)
        self.u = torch.zeros(slots, H, L, V, dtype=u_dtype, device=d)
        self.g = torch.zeros(slots, H, L, K, dtype=torch.float32, device=d)
        self.cur = [torch.zeros(slots, dtype=torch.int32, device=d) for _ in range(2)]

    def bytes_per_step(self, N, H):
        """DRAM bytes of a step averaged over a window (cursors spread): the checkpoint read
        every step and written every L-th, the live entries read (mean (L - 2) / 2), one
        appended, the token's inputs and output."""
        e = self.pool.element_size() * V * K
        entry = 2 * K + 4 + self.u.element_size() * V + 4 * K
        L = self.L
        per = e + e / L + entry * (L - 2) / 2 + entry * (L - 1) / L
        return N * H * (per + 3 * K * 2 + 2 * V * 2 + 2)

    def step(self, x, idx, out, flip, BV=32, warps=4, math=True, persistent=0, stages=2):
        """persistent > 0: that many programs an SM, each looping over (row, head, V-block)
        items with the next items' loads issued ahead (`stages`)."""
        N, H = idx.shape[0], self.H
        a = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["A_log"], x["dt_bias"], out, idx,
             self.cur[flip], self.cur[1 - flip], self.pool, self.k, self.r, self.u, self.g, H)
        kw = dict(L=self.L, LP=max(16, self.L), K=K, V=V, BV=BV, MATH=math, num_warps=warps)
        if persistent:
            sms = torch.cuda.get_device_properties(idx.device).multi_processor_count
            grid = min(N * H * (V // BV), persistent * sms)
            _replay_persistent[(grid,)](*a, N, K ** -0.5, LB, STAGES=stages, **kw)
        else:
            _replay_step[(V // BV, H, N)](*a, K ** -0.5, LB, **kw)


def tokens(N, H, gen):
    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)
    return dict(q=rnd(N, 1, H, K), k=rnd(N, 1, H, K), g=rnd(N, 1, H, K), v=rnd(N, 1, H, V),
                beta=rnd(N, 1, H))


def check(N, H, L, dtype, steps, u_dtype=torch.float16):
    """Replay against kda_cute.decode over `steps` tokens from one pool: outputs every step,
    the checkpoint after every fold (max relative errors)."""
    gen = torch.Generator(device="cuda").manual_seed(N + H + L)
    pool = torch.empty(2 * N, H, V, K, dtype=dtype, device="cuda").normal_(0, 0.3, generator=gen)
    idx = torch.randperm(2 * N, generator=gen, device="cuda")[:N].to(torch.int32)
    gate = dict(A_log=torch.randn(H, generator=gen, device="cuda") * 0.5,
                dt_bias=torch.randn(H * K, generator=gen, device="cuda") * 0.5)
    ring = Ring(pool.clone(), L, u_dtype)
    out_err, state_err = 0.0, 0.0
    for t in range(steps):
        x = dict(tokens(N, H, gen), **gate)
        o_ref = kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx,
                                lower_bound=LB, **gate)
        o = torch.empty_like(o_ref)
        ring.step(x, idx, o, t % 2)
        out_err = max(out_err, ((o.float() - o_ref.float()).norm()
                                / o_ref.float().norm()).item())
        if t % L == L - 1:
            a, b = ring.pool[idx.long()].float(), pool[idx.long()].float()
            state_err = max(state_err, ((a - b).norm() / b.norm()).item())
    torch.cuda.synchronize()
    return {"N": N, "H": H, "L": L, "pool": str(dtype)[6:], "u": str(u_dtype)[6:],
            "steps": steps, "out_vs_decode": out_err, "state_vs_decode": state_err}


def timed(N, H, L, dtype, bw, iters, flush, BV, warps, u_dtype=torch.float16, **variant):
    """One step's time, replay (cursors spread over the window, a filled ring) against
    kda_cute.decode, both graphed with the L2 flushed before every launch."""
    gen = torch.Generator(device="cuda").manual_seed(7 * N + H)
    slots = 4 * N
    pool = torch.empty(slots, H, V, K, dtype=dtype, device="cuda").normal_(0, 0.3, generator=gen)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:N].to(torch.int32)
    x = dict(tokens(N, H, gen), A_log=torch.randn(H, generator=gen, device="cuda") * 0.5,
             dt_bias=torch.randn(H * K, generator=gen, device="cuda") * 0.5)
    out = torch.empty(N, 1, H, V, dtype=torch.bfloat16, device="cuda")
    ring = Ring(pool.clone(), L, u_dtype)
    ring.k.normal_(generator=gen)
    ring.r.fill_(K ** -0.5)
    ring.u.normal_(0, 0.1, generator=gen)
    ring.g.copy_(torch.arange(1, L + 1, device="cuda").view(1, 1, L, 1) * -0.5)
    ring.cur[0].copy_(torch.randint(0, L, (slots,), generator=gen, device="cuda"))

    def kda():
        kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], pool, idx, out=out,
                        lower_bound=LB, A_log=x["A_log"], dt_bias=x["dt_bias"])

    def rep():
        ring.step(x, idx, out, 0, BV, warps, **variant)

    esz = pool.element_size()
    today = N * H * (2 * esz * V * K + 3 * K * 2 + 2 * V * 2 + 2)
    row = {"N": N, "H": H, "L": L, "pool": str(dtype)[6:], "BV": BV, "warps": warps, **variant,
           "decode_bytes": today, "replay_bytes": ring.bytes_per_step(N, H)}
    row["decode_ms"] = time_ms(graphed(kda), iters, flush)
    row["replay_ms"] = time_ms(graphed(rep), iters, flush)
    row["bytes_ratio"] = row["replay_bytes"] / today
    row["time_ratio"] = row["replay_ms"] / row["decode_ms"]
    row["decode_pct"] = 100 * today / bw * 1e3 / row["decode_ms"]
    row["replay_pct"] = 100 * row["replay_bytes"] / bw * 1e3 / row["replay_ms"]
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("replay_probe.json"))
    a = ap.parse_args(argv)
    res = {"device": torch.cuda.get_device_name(), "checks": [], "times": []}
    for L in (8, 16):
        for dtype in (torch.float32, torch.bfloat16):
            r = check(64, 8, L, dtype, steps=3 * L + 3)
            print(json.dumps(r), flush=True)
            res["checks"].append(r)
    r = check(64, 8, 16, torch.float32, steps=51, u_dtype=torch.float32)
    print(json.dumps(r), flush=True)
    res["checks"].append(r)
    bw = copy_bandwidth()
    res["copy_TBps"] = bw / 1e12
    flush = _flusher()
    shapes = [(256, 32), (1024, 32), (64, 32), (256, 12), (8, 32)]
    if a.quick:
        shapes = [(256, 32)]
    variants = [dict(BV=64, warps=4), dict(BV=64, warps=4, math=False)]
    variants += [dict(BV=bv, warps=w, persistent=p, stages=st, math=m)
                 for m in (True, False) for bv, w in ((64, 4), (32, 4)) for p in (2, 4)
                 for st in (2, 3)]
    for N, H in shapes:
        for dtype in (torch.float32, torch.bfloat16):
            for v in variants:
                try:
                    r = timed(N, H, 16, dtype, bw, 30, flush, **v)
                except Exception as e:  # a variant Triton cannot build is reported, not fatal
                    r = {"N": N, "H": H, "pool": str(dtype)[6:], **v, "error": repr(e)[:200]}
                print(json.dumps(r), flush=True)
                res["times"].append(r)
    a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
