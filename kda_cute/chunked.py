"""The chunked algorithm in plain torch: the kernels' debugging twin.

`chunk_intermediates` (K1) and `chunk_recurrence` (K2) are the kernels' two phases, written with
the kernels' workspace definitions so that a kernel's workspace can be checked phase by phase;
`kda_chunked` chains them, `segmented_recurrence` is the float64 model of K2 over segments
(kda_cute.segments). The math and the ground truth (`kda_reference`, the float64 token loop) are
kda_cute.reference's; layouts as there.
"""

from __future__ import annotations

import itertools
import math

import torch

from .reference import (
    _INTERMEDIATE_KEYS,
    _check_chunk,
    _check_float_tensor,
    _check_qkgb,
    _check_v,
    _initial_state,
    _resolve_scale,
    _seq_bounds,
    preprocess,
)


def _chunk_layout(bounds, chunk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Flattened-token index of every (sequence, chunk, position): pos [N, M, chunk] and
    valid [N, M, chunk], M = the most chunks of any sequence. Padded slots point at token 0 so
    gathers stay in bounds; callers mask them with `valid`."""
    M = max(((n + chunk - 1) // chunk for _, n in bounds), default=0)
    starts = torch.tensor([s for s, _ in bounds], dtype=torch.int64, device=device)
    lens = torch.tensor([n for _, n in bounds], dtype=torch.int64, device=device)
    local = torch.arange(M * chunk, dtype=torch.int64, device=device).view(1, M, chunk)
    valid = local < lens.view(-1, 1, 1)
    pos = torch.where(valid, starts.view(-1, 1, 1) + local, 0)
    return pos, valid


def _gather(x: torch.Tensor, pos: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """x [B,T,*rest] -> [*pos.shape, *rest], zero at padded slots."""
    blocks = x.reshape(-1, *x.shape[2:])[pos]
    mask = valid.view(*valid.shape, *([1] * (x.dim() - 2)))
    return torch.where(mask, blocks, torch.zeros((), dtype=x.dtype, device=x.device))


def _scatter_into(out: torch.Tensor, blocks: torch.Tensor, pos, valid) -> None:
    """Inverse of `_gather` for the valid slots: out [B,T,*rest] <- blocks [*pos.shape, *rest]."""
    out.view(-1, *out.shape[2:])[pos[valid]] = blocks[valid]


def _unit_lower_inverse(L: torch.Tensor) -> torch.Tensor:
    """(I + tril(L, -1))^{-1} for L [..., C, C]; only the strictly lower part of L is read. Forward
    substitution works in every float dtype (LAPACK's triangular solve has no bf16/fp16 on CPU)."""
    C = L.shape[-1]
    eye = torch.eye(C, dtype=L.dtype, device=L.device)
    X = torch.zeros_like(L)
    for i in range(C):
        X[..., i, :] = eye[i] - (L[..., i:i + 1, :i] @ X[..., :i, :]).squeeze(-2)
    return X


def chunk_intermediates(qn, kn, a, b, *, chunk, scale, cu_seqlens=None, sub=None,
                        operand_round=None):
    """K1's outputs, token-indexed. Inputs are already preprocessed (from `preprocess`), any float
    dtype; computed in qn's dtype. Shapes as above ([B,T,H,K] etc). Chunks start at each sequence's
    start (for cu_seqlens: at cu_seqlens[n]; for fixed length: at t=0 of each batch row) and have
    `chunk` tokens, the last one of a sequence possibly fewer. With G[t] = sum of a over the chunk's
    tokens up to and including t, and Gl = G at the chunk's last valid token, returns a dict:
      "qg": scale * qn * exp(G)                                  [B,T,H,K]
      "kg": kn * exp(G)                                          [B,T,H,K]
      "kd": kn * exp(Gl - G)                                     [B,T,H,K]
      "gl": exp(Gl), stored at every token of the chunk          [B,T,H,K]
      "Aw": row (t - chunk_start) of (I + L)^{-1} diag(b)       [B,T,H,chunk]
      "Mq": row (t - chunk_start) of Mqk                         [B,T,H,chunk]
    where for tokens i, j of one chunk (local indices), with e_ij = exp(G_i - G_j) elementwise
    over K:
      L[i,j]   = b_i * sum_d kn_i,d kn_j,d e_ij,d        for j < i, else 0
      Mqk[i,j] = scale * sum_d qn_i,d kn_j,d e_ij,d      for j <= i, else 0
    e_ij is exp of the difference, never exp(-G) alone, which overflows for strong unbounded
    decays. Columns >= the chunk's valid length are zero.
    sub: compute the pairs of different sub-chunks of `sub` tokens as matrix products factored
    through the sub-chunk boundary r (e^(G_i - r) e^(r - G_j), both factors <= 1), the way a
    tensor-core K1 does; pairs inside one sub-chunk stay elementwise. operand_round rounds the
    factored operands (e.g. `round_bf16`) to emulate the tensor cores' input precision."""
    B, T, H, _ = _check_qkgb(qn, kn, a, b, names=("qn", "kn", "a", "b"))
    _check_chunk(chunk)
    dtype = qn.dtype
    pos, valid = _chunk_layout(_seq_bounds(B, T, cu_seqlens), chunk, qn.device)
    # Every chunk holding a token, flattened over sequences: K1 is parallel over all of them.
    has_tokens = valid[:, :, 0]
    pos, valid = pos[has_tokens], valid[has_tokens]
    q_c, k_c, a_c = (_gather(x.to(dtype), pos, valid) for x in (qn, kn, a))  # [NC, C, H, K]
    b_c = _gather(b.to(dtype), pos, valid)  # [NC, C, H]

    G = torch.cumsum(a_c, dim=1)
    # Padded slots carry a = 0, so the chunk's last row already holds G at its last valid token.
    Gl = G[:, -1:]
    blocks = {
        "qg": scale * q_c * torch.exp(G),
        "kg": k_c * torch.exp(G),
        "kd": k_c * torch.exp(Gl - G),
        "gl": torch.exp(Gl).expand_as(G),
    }

    NC, C = pos.shape
    L = q_c.new_zeros(NC, C, H, C)  # [chunk, row i, head, column j]
    Mq = q_c.new_zeros(NC, C, H, C)
    rows = torch.arange(C, device=qn.device).view(1, C, 1, 1)
    for j in range(C):
        # Rows i < j are masked before exp: there G_i - G_j > 0 and can overflow to inf.
        e = torch.exp((G - G[:, j:j + 1]).masked_fill(rows < j, -math.inf))
        kj = k_c[:, j:j + 1] * e
        Mq[..., j] = scale * (q_c * kj).sum(-1)
        L[..., j] = b_c * (k_c * kj).sum(-1)  # diagonal unused: the inverse reads tril(L, -1)
    if sub is not None:
        _factor_off_diagonal(L, Mq, q_c, k_c, b_c, G, scale, sub, operand_round)
    inv = _unit_lower_inverse(L.transpose(1, 2))  # [NC, H, C, C]
    blocks["Aw"] = (inv * b_c.transpose(1, 2).unsqueeze(-2)).transpose(1, 2)
    blocks["Mq"] = Mq

    out = {}
    for name, blk in blocks.items():
        out[name] = blk.new_zeros(B, T, *blk.shape[2:])
        _scatter_into(out[name], blk, pos, valid)
    return out


def _factor_off_diagonal(L, Mq, q_c, k_c, b_c, G, scale, sub, operand_round):
    """Overwrite the blocks of L and Mq below the diagonal sub-blocks with factored products."""
    C = G.shape[1]
    if sub < 1 or C % sub:
        raise ValueError(f"sub: expected a positive divisor of chunk {C}, got {sub}")
    rnd = operand_round or (lambda x: x)
    for start in range(sub, C, sub):
        rows = slice(start, start + sub)
        r = G[:, start - 1:start]  # G at the boundary: G_i - r <= 0 <= G_j - r for j < start
        fwd = torch.exp(G[:, rows] - r)
        left_k, left_q = rnd(k_c[:, rows] * fwd), rnd(q_c[:, rows] * fwd)
        right = rnd(k_c[:, :start] * torch.exp(r - G[:, :start]))
        L[:, rows, :, :start] = b_c[:, rows, :, None] * torch.einsum(
            "nihd,njhd->nihj", left_k, right)
        Mq[:, rows, :, :start] = scale * torch.einsum("nihd,njhd->nihj", left_q, right)


def chunk_recurrence(inter, v, *, chunk, initial_state=None, cu_seqlens=None, operand_round=None):
    """K2's math from chunk_intermediates' dict: per sequence, per chunk (local tokens 0..c-1),
    S [V,K]:
      W = v_chunk - kg_chunk @ S^T ;  U = Aw_chunk[:, :c] @ W
      O = qg_chunk @ S^T + Mq_chunk[:, :c] @ U
      S = S * gl_row[None, :] + U^T @ kd_chunk
    Returns (out [B,T,H,V], final_state [N,H,V,K]) in the dtype of the intermediates.
    Only the valid tokens and columns of each chunk are read, so a kernel's workspace with garbage
    in its padding can be fed in as is.
    operand_round: optional function applied to both operands of the three state products
    (kg S^T, qg S^T, U^T kd), to emulate the input precision of tensor cores (e.g. `round_tf32`);
    accumulation stays in the intermediates' dtype."""
    if not isinstance(inter, dict) or any(key not in inter for key in _INTERMEDIATE_KEYS):
        raise ValueError(f"inter: expected a dict with keys {_INTERMEDIATE_KEYS}, got "
                         f"{sorted(inter) if isinstance(inter, dict) else type(inter).__name__}")
    _check_chunk(chunk)
    qg, kg, kd, gl, Aw, Mq = (inter[key] for key in _INTERMEDIATE_KEYS)
    _check_float_tensor(qg, "qg", 4)
    B, T, H, K = qg.shape
    for x, name, last in ((kg, "kg", K), (kd, "kd", K), (gl, "gl", K), (Aw, "Aw", chunk),
                          (Mq, "Mq", chunk)):
        _check_float_tensor(x, name, 4)
        if tuple(x.shape) != (B, T, H, last):
            raise ValueError(f"{name}: expected shape {(B, T, H, last)}, got {tuple(x.shape)}")
    V = _check_v(v, B, T, H)
    dtype, device = qg.dtype, qg.device
    bounds = _seq_bounds(B, T, cu_seqlens)
    S = _initial_state(initial_state, len(bounds), H, V, K, dtype, device)
    kg, kd, gl, Aw, Mq, v = (x.to(dtype) for x in (kg, kd, gl, Aw, Mq, v))
    pos, valid = _chunk_layout(bounds, chunk, device)

    out = torch.zeros(B, T, H, V, dtype=dtype, device=device)
    one = torch.ones((), dtype=dtype, device=device)
    gl_flat = gl.reshape(B * T, H, K)
    # Sequences with fewer chunks than the longest run identity chunks (all zero, gl = 1), which
    # leave S exactly unchanged, so every step is batched over all sequences.
    for m in range(pos.shape[1]):
        p, ok = pos[:, m], valid[:, m]  # [N, C]
        qg_m, kg_m, kd_m, v_m = (_gather(x, p, ok).transpose(1, 2) for x in (qg, kg, kd, v))
        col_ok = ok[:, None, None, :]
        Aw_m, Mq_m = (torch.where(col_ok, _gather(x, p, ok).transpose(1, 2), 0) for x in (Aw, Mq))
        gl_m = torch.where(ok[:, 0, None, None], gl_flat[p[:, 0]], one)  # [N, H, K]

        r = operand_round or (lambda x: x)
        St = r(S).transpose(-1, -2)
        U = Aw_m @ (v_m - r(kg_m) @ St)
        out_m = r(qg_m) @ St + Mq_m @ U
        S = S * gl_m[:, :, None, :] + r(U).transpose(-1, -2) @ r(kd_m)
        _scatter_into(out, out_m.transpose(1, 2), p, ok)
    return out, S


def segmented_recurrence(inter, v, *, chunk, segments, initial_state=None, rerun=False):
    """chunk_recurrence for one sequence (B == 1, no cu_seqlens) split into `segments` runs of
    whole chunks that start independently: the math of a K2 that parallelises inside a sequence.

    Each chunk maps the state affinely, S -> S A_c + B_c with A_c = diag(gl) - kg^T Aw^T kd [K, K]
    and B_c = v^T Aw^T kd [V, K]. Pass 1 (parallel over segments) runs each segment from zero
    with the identity stacked under the state, [S; I] ([V + K, K]): the top rows end as the
    segment's B, the bottom rows as its A. A short serial pass chains the segments' starting
    states, S_(j+1) = S_j A_j + B_j. The output is linear in a segment's starting state too: the
    identity rows' outputs O_I [K per token] give out = out_from_zero + S_start O_I, a per-segment
    product (parallel). With `rerun`, pass 2 instead reruns each segment from its true start.
    Returns (out, final_state) like chunk_recurrence."""
    qg = inter["qg"]
    B, T, H, K = qg.shape
    if B != 1:
        raise ValueError(f"qg: expected one sequence (B == 1), got B = {B}")
    V = v.shape[-1]
    n_chunks = (T + chunk - 1) // chunk
    if not 1 <= segments <= max(1, n_chunks):
        raise ValueError(f"segments: expected 1..{max(1, n_chunks)}, got {segments}")
    dtype, device = qg.dtype, qg.device
    S0 = _initial_state(initial_state, 1, H, V, K, dtype, device)
    per = (n_chunks + segments - 1) // segments
    edges = [min(T, j * per * chunk) for j in range(segments + 1)]
    spans = [(s, e) for s, e in itertools.pairwise(edges) if e > s]

    # pass 1: each segment's affine map, from [0; I]
    eye = torch.eye(K, dtype=dtype, device=device).expand(1, H, K, K)
    maps, o_zero, o_eye = [], [], []
    for s, e in spans:
        sub = {key: x[:, s:e] for key, x in inter.items()}
        zero_v = torch.zeros(1, e - s, H, K, dtype=dtype, device=device)
        # the identity block follows the linear part only: it sees no values (v = 0)
        o_top, top = chunk_recurrence(sub, v[:, s:e], chunk=chunk)
        o_bot, bottom = chunk_recurrence(sub, zero_v, chunk=chunk, initial_state=eye)
        maps.append((bottom[0], top[0]))  # A [H, K, K], B [H, V, K]
        o_zero.append(o_top)
        o_eye.append(o_bot)  # [1, t, H, K]: row k is the output the state's basis row k gives
    # the serial pass: true starting state of every segment
    starts, S = [], S0[0]
    for A, Bm in maps:
        starts.append(S)
        S = S @ A + Bm
    out = torch.zeros(1, T, H, V, dtype=dtype, device=device)
    for j, ((s, e), St) in enumerate(zip(spans, starts, strict=True)):
        if rerun:  # pass 2: the segment again, from its true start
            sub = {key: x[:, s:e] for key, x in inter.items()}
            out[:, s:e], _ = chunk_recurrence(sub, v[:, s:e], chunk=chunk,
                                              initial_state=St[None])
        else:  # the correction: out += S_start O_I, token by token
            out[:, s:e] = o_zero[j] + torch.einsum("hvk,bthk->bthv", St, o_eye[j])
    return out, S[None]


def kda_chunked(q, k, v, g, beta, *, chunk=16, dtype=torch.float64, scale=None, initial_state=None,
                cu_seqlens=None, A_log=None, dt_bias=None, lower_bound=None, gate="bounded",
                qk_l2norm=True, beta_sigmoid=True):
    """preprocess -> chunk_intermediates -> chunk_recurrence, all in `dtype`."""
    B, T, H, K = _check_qkgb(q, k, g, beta)
    _check_v(v, B, T, H)
    _check_chunk(chunk)
    qn, kn, a, b = preprocess(q, k, g, beta, A_log=A_log, dt_bias=dt_bias,
                              lower_bound=lower_bound, gate=gate, qk_l2norm=qk_l2norm,
                              beta_sigmoid=beta_sigmoid, dtype=dtype)
    inter = chunk_intermediates(qn, kn, a, b, chunk=chunk, scale=_resolve_scale(scale, K),
                                cu_seqlens=cu_seqlens)
    return chunk_recurrence(inter, v.to(dtype), chunk=chunk, initial_state=initial_state,
                            cu_seqlens=cu_seqlens)
