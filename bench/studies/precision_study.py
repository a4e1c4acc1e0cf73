"""CPU study: what tensor-core operand precision does to KDA's accuracy, before writing the kernel.

Runs the chunked twin (kda_cute.reference) in float32 with the operands of K2's three state
products rounded to bf16 or tf32 (accumulation in fp32), the output rounded to bf16 as the
kernel's is, against the float64 loop, on FlashKDA-benchmark-like inputs (K = V = 128,
lower_bound -5).

    python bench/studies/precision_study.py [--T 1024] [--H 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kda_cute.chunked import chunk_intermediates, chunk_recurrence
from kda_cute.reference import kda_reference, preprocess, rel_err, round_bf16, round_tf32


def study_inputs(T, H, K, decay=None):
    """One sequence of FlashKDA-benchmark-like inputs (bf16 q, k, g, v, beta ~ N(0, 1), A_log,
    dt_bias ~ U(0, 1), the bounded gate with lower_bound -5, an fp32 initial state), or with
    `decay` a constant log-space decay per token instead (gate "none"). Returns v, the initial
    state, the float64 reference (out, final state) and K1's fp32 preprocessing (qn, kn, a, b)."""
    gen = torch.Generator().manual_seed(0)
    B = 1
    q, k, g, v = (torch.randn(B, T, H, K, generator=gen).to(torch.bfloat16) for _ in range(4))
    beta = torch.randn(B, T, H, generator=gen).to(torch.bfloat16)
    A_log, dt_bias = torch.rand(H, generator=gen), torch.rand(H, K, generator=gen)
    s0 = torch.randn(B, H, K, K, generator=gen)
    kw = dict(lower_bound=-5.0, gate="bounded")
    if decay is not None:
        g = torch.full_like(g, decay)
        kw = dict(lower_bound=None, gate="none")
    ref = kda_reference(q.double(), k.double(), v.double(), g.double(), beta.double(),
                        initial_state=s0.double(), A_log=A_log.double(),
                        dt_bias=dt_bias.double(), **kw)
    pre = preprocess(q.float(), k.float(), g.float(), beta.float(), dtype=torch.float32,
                     A_log=A_log, dt_bias=dt_bias, **kw)
    return v, s0, ref, pre


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--K", type=int, default=128)
    a = ap.parse_args(argv)
    K = a.K
    v, s0, (ref_o, ref_s), (qn, kn, al, b) = study_inputs(a.T, a.H, K)
    rows = []
    # K1 on tensor cores: chunk 64, sub-chunks of 16 factored, the factored operands in bf16
    for sub, rnd in ((16, None), (16, round_bf16)):
        inter = chunk_intermediates(qn, kn, al, b, chunk=64, scale=K ** -0.5, sub=sub,
                                    operand_round=rnd)
        o, s = chunk_recurrence(inter, v.float(), chunk=64, initial_state=s0)
        row = {"chunk": 64, "variant": f"K1 factored sub {sub}, "
               f"{'bf16' if rnd else 'fp32'} operands; K2 fp32",
               "out_err": rel_err(o.to(torch.bfloat16), ref_o), "state_err": rel_err(s, ref_s)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    for chunk in (16, 64):
        inter = chunk_intermediates(qn, kn, al, b, chunk=chunk, scale=K ** -0.5)
        for name, rnd, ws in (("fp32", None, None), ("tf32 operands", round_tf32, None),
                              ("bf16 operands", round_bf16, None),
                              ("tf32 operands, bf16 workspace", round_tf32, round_bf16)):
            it = {n: (ws(x) if ws is not None and n in ("qg", "kg", "kd") else x)
                  for n, x in inter.items()}
            o, s = chunk_recurrence(it, v.float(), chunk=chunk, initial_state=s0,
                                    operand_round=rnd)
            row = {"chunk": chunk, "variant": name,
                   "out_err": rel_err(o.to(torch.bfloat16), ref_o), "state_err": rel_err(s, ref_s)}
            rows.append(row)
            print(json.dumps(row), flush=True)

    # K1's phase B as the kernel runs it: every pair of a chunk factored through G at row C/2 - 1,
    # e^(G_i - r) e^(r - G_j), the factors rounded as the MMA operands are (hi + lo: ~16 bits;
    # plain bf16: 8), K2 in fp32 (T a multiple of the chunk here)
    for chunk in (16, 32):
        inter = chunk_intermediates(qn, kn, al, b, chunk=chunk, scale=K ** -0.5)
        for name, rnd in (("hi+lo", lambda x: round_bf16(x) + round_bf16(x - round_bf16(x))),
                          ("bf16", round_bf16)):
            it = dict(inter)
            it["Aw"], it["Mq"] = _phase_b_factored(qn, kn, al, b, chunk, K ** -0.5, rnd)
            o, s = chunk_recurrence(it, v.float(), chunk=chunk, initial_state=s0)
            row = {"chunk": chunk, "variant": f"K1 phase B through row C/2-1, {name} operands; "
                   "K2 fp32", "out_err": rel_err(o.to(torch.bfloat16), ref_o),
                   "state_err": rel_err(s, ref_s)}
            rows.append(row)
            print(json.dumps(row), flush=True)


def _phase_b_factored(qn, kn, a, b, C, scale, rnd):
    """Aw and Mq [B, T, H, C] from L and Mqk computed as K1's phase B does (fixed length, T a
    multiple of C): products of rounded factors through r = G at the chunk's row C/2 - 1."""
    B, T, H, K = qn.shape
    NC = B * T // C
    q_c, k_c, a_c = (x.reshape(NC, C, H, K) for x in (qn, kn, a))
    b_c = b.reshape(NC, C, H)
    G = torch.cumsum(a_c, dim=1)
    r = G[:, C // 2 - 1:C // 2]
    fwd, bwd = torch.exp(G - r), torch.exp(r - G)
    right = rnd(k_c * bwd)
    L = b_c[..., None] * torch.einsum("nihd,njhd->nihj", rnd(k_c * fwd), right)
    Mq = scale * torch.einsum("nihd,njhd->nihj", rnd(q_c * fwd), right)
    i = torch.arange(C).view(1, C, 1, 1)
    j = torch.arange(C).view(1, 1, 1, C)
    L, Mq = L.masked_fill(j >= i, 0.0), Mq.masked_fill(j > i, 0.0)
    eye = torch.eye(C, dtype=L.dtype)
    inv = torch.linalg.solve_triangular(eye + L.transpose(1, 2), eye.expand(NC, H, C, C),
                                        upper=False, unitriangular=True)
    Aw = (inv * b_c.transpose(1, 2).unsqueeze(-2)).transpose(1, 2)
    return Aw.reshape(B, T, H, C), Mq.reshape(B, T, H, C)


if __name__ == "__main__":
    main()
