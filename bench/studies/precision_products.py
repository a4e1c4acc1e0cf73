"""CPU study: which of K2's hi/lo products can go (and with them K1's lo planes).

K2 computes U = W Aw^T, O = Pq + U Mq^T and S += U^T kd each as three bf16 products of hi/lo
splits (Ah Bh + Ah Bl + Al Bh, ~16 bits), and P, Pq from bf16(S). This emulates that in fp32
on a fixed-length sequence (chunk 16, T a multiple of it) with K1's workspace rounded as K1
writes it (qg, kg bf16; kd, Aw, Mq hi + lo), and drops one term of one product at a time: "no B
lo" (Ah Bh + Al Bh: the operand K1 writes needs no lo plane) or "no A lo" (Ah Bh + Ah Bl), or
keeps one product (Ah Bh), or runs it as one product of fp16 operands ("fp16": 10 mantissa
bits, as an f16 warpgroup MMA takes them). Errors against the float64 loop,
FlashKDA-benchmark-like inputs.

    python bench/studies/precision_products.py [--T 1024] [--H 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from precision_study import study_inputs  # noqa: E402

from kda_cute.chunked import chunk_intermediates  # noqa: E402
from kda_cute.reference import rel_err, round_bf16  # noqa: E402


def hi(x):
    return round_bf16(x)


def lo(x):
    return round_bf16(x - round_bf16(x))


def fp16(x):
    return x.to(torch.float16).to(torch.float32)


def product(a, b, mode):
    """a @ b as the kernel's bf16 MMAs compute it (fp32 accumulation); "fp16": one product of
    fp16 operands (10 mantissa bits against bf16's 7), as an f16 wgmma would."""
    if mode == "fp16":
        return fp16(a) @ fp16(b)
    if mode == "3":
        return hi(a) @ hi(b) + hi(a) @ lo(b) + lo(a) @ hi(b)
    if mode == "no B lo":
        return hi(a) @ hi(b) + lo(a) @ hi(b)
    if mode == "no A lo":
        return hi(a) @ hi(b) + hi(a) @ lo(b)
    return hi(a) @ hi(b)  # "1"


def k2(inter, v, C, s0, modes):
    """K2's chunk loop for one fixed-length batch (T % C == 0), S [B, H, V, K]."""
    qg, kg, kd, gl, Aw, Mq = (inter[n] for n in ("qg", "kg", "kd", "gl", "Aw", "Mq"))
    B, T, H, K = qg.shape
    S = s0.clone()
    out = torch.empty(B, T, H, v.shape[-1])
    for c in range(T // C):
        sl = slice(c * C, (c + 1) * C)
        q_, k_, d_, v_, aw, mq = (x[:, sl].transpose(1, 2) for x in (qg, kg, kd, v, Aw, Mq))
        St = hi(S).transpose(-1, -2)  # P and Pq from bf16(S)
        if modes.get("P") == "fp16":  # P, Pq from fp16 S, kg and qg
            W = v_ - fp16(k_) @ fp16(S).transpose(-1, -2)
            Pq = fp16(q_) @ fp16(S).transpose(-1, -2)
        elif modes.get("P") == "S hi/lo":  # and S's lo part: two products each
            Sl = lo(S).transpose(-1, -2)
            W = v_ - hi(k_) @ St - hi(k_) @ Sl
            Pq = hi(q_) @ St + hi(q_) @ Sl
        else:
            W = v_ - hi(k_) @ St
            Pq = hi(q_) @ St
        U = product(aw, W, modes["U"])  # [C, C] x [C, V]
        o_c = Pq + product(mq, U, modes["O"])
        S = S * gl[:, c * C].unsqueeze(-2) + product(U.transpose(-1, -2), d_, modes["S"])
        out[:, sl] = o_c.transpose(1, 2)
    return out, S


def k2_lookahead(inter, v, C, s0, x_mode):
    """K2 with the serial chain cut at the state update: chunk c's P = kg_c S_c^T taken as
    kg_c (S_(c-1) diag(gl))^T + X_c U_(c-1), X_c = kg_c kd_(c-1)^T [C, C] (computable as soon as
    both tiles are in smem), so P needs U_(c-1), not the updated state. x_mode: how X_c enters
    its product with U ("3": hi/lo both, "no A lo": X in plain bf16)."""
    qg, kg, kd, gl, Aw, Mq = (inter[n] for n in ("qg", "kg", "kd", "gl", "Aw", "Mq"))
    B, T, H, K = qg.shape
    S = s0.clone()
    out = torch.empty(B, T, H, v.shape[-1])
    U_prev = d_prev = S_dec = None
    for c in range(T // C):
        sl = slice(c * C, (c + 1) * C)
        q_, k_, d_, v_, aw, mq = (x[:, sl].transpose(1, 2) for x in (qg, kg, kd, v, Aw, Mq))
        if U_prev is None:
            P = hi(k_) @ hi(S).transpose(-1, -2)
        else:
            X = hi(k_) @ (hi(d_prev) + lo(d_prev)).transpose(-1, -2)  # fp32 accumulation
            P = hi(k_) @ hi(S_dec).transpose(-1, -2) + product(X, U_prev, x_mode)
        U = product(aw, v_ - P, "3")
        o_c = hi(q_) @ hi(S).transpose(-1, -2) + product(mq, U, "3")
        S_dec = S * gl[:, c * C].unsqueeze(-2)
        S = S_dec + product(U.transpose(-1, -2), d_, "3")
        U_prev, d_prev = U, d_
        out[:, sl] = o_c.transpose(1, 2)
    return out, S


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--H", type=int, default=2)
    ap.add_argument("--decay", type=float, default=None,
                    help="a constant log-space decay per token (gate 'none', e.g. -0.02: a "
                         "state that remembers many chunks) instead of the bounded gate")
    a = ap.parse_args(argv)
    K, C = 128, 16
    v, s0, (ref_o, ref_s), (qn, kn, al, b) = study_inputs(a.T, a.H, K, a.decay)
    inter = chunk_intermediates(qn, kn, al, b, chunk=C, scale=K ** -0.5)
    # as K1 writes them: qg, kg bf16; kd, Aw, Mq hi + lo (the products split them again)
    inter = {n: (hi(x) if n in ("qg", "kg") else x) for n, x in inter.items()}
    # Aw and Mq as [B, T, H, C] rows of the chunk's matrices (row i of chunk c at token cC + i)
    base = {"U": "3", "O": "3", "S": "3"}
    variants = [("all three-term", base), ("P, Pq from S hi/lo too", {**base, "P": "S hi/lo"})]
    # (product, its A operand, its B operand): U = Aw W, O = Mq U, S += U^T kd
    for prod, a_name, b_name in (("U", "Aw", "W"), ("O", "Mq", "U"), ("S", "U", "kd")):
        for mode, what in (("no A lo", f"no {a_name} lo"), ("no B lo", f"no {b_name} lo"),
                           ("1", "one product"), ("fp16", "one fp16 product")):
            variants.append((f"{prod}: {what}", {**base, prod: mode}))
    variants.append(("U, O, S: one fp16 product each", {"U": "fp16", "O": "fp16", "S": "fp16"}))
    variants.append(("U, S: one fp16 product each", {**base, "U": "fp16", "S": "fp16"}))
    variants.append(("P, Pq, U, O, S: fp16", {"P": "fp16", "U": "fp16", "O": "fp16",
                                              "S": "fp16"}))
    for name, modes in variants:
        o, s = k2(inter, v.float(), C, s0, modes)
        row = {"variant": name, "out_err": rel_err(o.to(torch.bfloat16), ref_o),
               "state_err": rel_err(s, ref_s)}
        print(json.dumps(row), flush=True)
    for x_mode in ("3", "no A lo"):
        o, s = k2_lookahead(inter, v.float(), C, s0, x_mode)
        row = {"variant": f"lookahead P, X_c U_(c-1) as {x_mode!r}",
               "out_err": rel_err(o.to(torch.bfloat16), ref_o), "state_err": rel_err(s, ref_s)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
