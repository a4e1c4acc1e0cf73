"""Kimi Delta Attention in plain torch: the ground truth and the chunked algorithm's debugging twin.

The math is in docs/kda.md. `kda_reference` is the float64 loop over tokens that every kernel is
tested against. `chunk_intermediates` (K1) and `chunk_recurrence` (K2) are the kernels' two phases,
written with the kernels' workspace definitions so a kernel's workspace can be checked phase by
phase;
`kda_chunked` chains them. `rel_err` is the one error measure the tests use.

Layouts: q, k, g [B, T, H, K]; v and out [B, T, H, V]; beta [B, T, H]; states [N, H, V, K]. With
`cu_seqlens` ([N+1], int32 or int64) B must be 1 and N sequences are packed along T.
"""

from __future__ import annotations

import itertools
import math

import torch

GATE_FORMS = ("bounded", "unbounded", "none")

_L2NORM_EPS = 1e-6
_INTERMEDIATE_KEYS = ("qg", "kg", "kd", "gl", "Aw", "Mq")


# ----------------------------------------------------------------------------------------------
# Input checks
# ----------------------------------------------------------------------------------------------


def _check_float_tensor(x, name: str, ndim: int) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {x.dtype}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dims, got shape {tuple(x.shape)}")


def _check_qkgb(q, k, g, beta, names=("q", "k", "g", "beta")) -> tuple[int, int, int, int]:
    """Shapes of the per-key inputs; returns (B, T, H, K)."""
    for x, name in zip((q, k, g), names[:3], strict=True):
        _check_float_tensor(x, name, 4)
    _check_float_tensor(beta, names[3], 3)
    shape = tuple(q.shape)
    for x, name in zip((k, g), names[1:3], strict=True):
        if tuple(x.shape) != shape:
            raise ValueError(f"{name}: expected shape {shape} (that of {names[0]}), "
                             f"got {tuple(x.shape)}")
    if tuple(beta.shape) != shape[:3]:
        raise ValueError(f"{names[3]}: expected shape {shape[:3]}, got {tuple(beta.shape)}")
    return shape


def _check_v(v, B: int, T: int, H: int, name: str = "v") -> int:
    _check_float_tensor(v, name, 4)
    if tuple(v.shape[:3]) != (B, T, H):
        raise ValueError(f"{name}: expected shape ({B}, {T}, {H}, V), got {tuple(v.shape)}")
    return v.shape[3]


def _check_chunk(chunk) -> None:
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk: expected a positive int, got {chunk!r}")


def _resolve_scale(scale, K: int) -> float:
    return K ** -0.5 if scale is None else float(scale)


def _seq_bounds(B: int, T: int, cu_seqlens) -> list[tuple[int, int]]:
    """(start, length) of every sequence on the flattened [B*T] token axis."""
    if cu_seqlens is None:
        return [(n * T, T) for n in range(B)]
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens: expected a torch.Tensor, got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens: expected shape [N+1] with N >= 1, "
                         f"got {tuple(cu_seqlens.shape)}")
    if B != 1:
        raise ValueError(f"cu_seqlens: packed sequences need batch size 1, got B={B}")
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != T:
        raise ValueError(f"cu_seqlens: expected to start at 0 and end at T={T}, "
                         f"got {cu[0]} and {cu[-1]}")
    if any(e < s for s, e in itertools.pairwise(cu)):
        raise ValueError(f"cu_seqlens: expected non-decreasing offsets, got {cu}")
    return [(s, e - s) for s, e in itertools.pairwise(cu)]


def _initial_state(initial_state, N: int, H: int, V: int, K: int, dtype, device) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros(N, H, V, K, dtype=dtype, device=device)
    _check_float_tensor(initial_state, "initial_state", 4)
    if tuple(initial_state.shape) != (N, H, V, K):
        raise ValueError(f"initial_state: expected shape {(N, H, V, K)} (N, H, V, K), "
                         f"got {tuple(initial_state.shape)}")
    return initial_state.to(device=device, dtype=dtype).clone()


def _dt_bias(dt_bias, H: int, K: int, dtype, device) -> torch.Tensor:
    if dt_bias is None:
        return torch.zeros(H, K, dtype=dtype, device=device)
    if not isinstance(dt_bias, torch.Tensor):
        raise TypeError(f"dt_bias: expected a torch.Tensor or None, got {type(dt_bias).__name__}")
    if tuple(dt_bias.shape) not in ((H, K), (H * K,)):
        raise ValueError(f"dt_bias: expected shape ({H}, {K}) or ({H * K},), "
                         f"got {tuple(dt_bias.shape)}")
    return dt_bias.to(device=device, dtype=dtype).reshape(H, K)


# ----------------------------------------------------------------------------------------------
# Preprocessing and the token loop
# ----------------------------------------------------------------------------------------------


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


def preprocess(q, k, g, beta, *, A_log=None, dt_bias=None, lower_bound=None, gate="bounded",
               qk_l2norm=True, beta_sigmoid=True, dtype=torch.float64):
    """Returns (qn, kn, a, b) in `dtype`: q/k [B,T,H,K] L2-normalised over the last dim if qk_l2norm
    (x / sqrt(sum(x^2) + 1e-6)), a [B,T,H,K] natural-log decay, b [B,T,H] beta (sigmoid if
    beta_sigmoid).
    gate="bounded":   a = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))
    gate="unbounded": a = -exp(A_log[h]) * softplus(g + dt_bias[h])
    gate="none":      a = g  (already a log-space decay)
    A_log: [H] fp32; dt_bias: [H, K] (also accept [H*K]) or None meaning zero."""
    _, _, H, K = _check_qkgb(q, k, g, beta)
    if gate not in GATE_FORMS:
        raise ValueError(f"gate: expected one of {GATE_FORMS}, got {gate!r}")
    device = q.device
    qn, kn, g, b = (x.to(dtype) for x in (q, k, g, beta))
    if qk_l2norm:
        qn, kn = _l2norm(qn), _l2norm(kn)
    if beta_sigmoid:
        b = torch.sigmoid(b)
    if gate == "none":
        return qn, kn, g, b

    if not isinstance(A_log, torch.Tensor):
        raise TypeError(f"A_log: expected a tensor of shape ({H},) for gate={gate!r}, "
                        f"got {type(A_log).__name__}")
    if tuple(A_log.shape) != (H,):
        raise ValueError(f"A_log: expected shape ({H},), got {tuple(A_log.shape)}")
    rate = torch.exp(A_log.to(device=device, dtype=dtype)).view(1, 1, H, 1)
    x = g + _dt_bias(dt_bias, H, K, dtype, device)
    if gate == "bounded":
        if lower_bound is None:
            raise ValueError("lower_bound: expected a float for gate='bounded', got None")
        a = float(lower_bound) * torch.sigmoid(rate * x)
    else:
        # logaddexp(x, 0) is softplus without torch's threshold cut-over (x > 20 -> x), which is off
        # by ~exp(-20), visible at float64 tolerances.
        a = -rate * torch.logaddexp(x, torch.zeros((), dtype=dtype, device=device))
    return qn, kn, a, b


def _token_loop(qn, kn, v, a, b, S, scale):
    """The recurrence over T for a batch of independent rows: qn, kn, a [R,T,H,K]; v [R,T,H,V];
    b [R,T,H]; S [R,H,V,K] (not modified). Returns (out [R,T,H,V], S after the last token)."""
    decay = torch.exp(a)
    out = v.new_empty(v.shape)
    for t in range(qn.shape[1]):
        S = S * decay[:, t, :, None, :]
        kt = kn[:, t, :, :, None]
        err = v[:, t] - (S @ kt).squeeze(-1)
        S = S + b[:, t, :, None, None] * err[..., None] * kt.transpose(-1, -2)
        out[:, t] = scale * (S @ qn[:, t, :, :, None]).squeeze(-1)
    return out, S


def kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                  A_log=None, dt_bias=None, lower_bound=None, gate="bounded",
                  qk_l2norm=True, beta_sigmoid=True):
    """The ground truth: a float64 loop over tokens. q,k,g [B,T,H,K]; v [B,T,H,V]; beta [B,T,H].
    cu_seqlens (int64 or int32, [N+1]) requires B == 1 and packs N sequences along T.
    initial_state [N,H,V,K] any float dtype or None (zeros). scale default K**-0.5.
    Returns (out [B,T,H,V] float64, final_state [N,H,V,K] float64)."""
    B, T, H, K = _check_qkgb(q, k, g, beta)
    V = _check_v(v, B, T, H)
    bounds = _seq_bounds(B, T, cu_seqlens)
    f64 = torch.float64
    S0 = _initial_state(initial_state, len(bounds), H, V, K, f64, q.device)
    scale = _resolve_scale(scale, K)
    qn, kn, a, b = preprocess(q, k, g, beta, A_log=A_log, dt_bias=dt_bias,
                              lower_bound=lower_bound, gate=gate, qk_l2norm=qk_l2norm,
                              beta_sigmoid=beta_sigmoid, dtype=f64)
    v = v.to(f64)
    if cu_seqlens is None:
        return _token_loop(qn, kn, v, a, b, S0, scale)

    out = torch.zeros(B, T, H, V, dtype=f64, device=q.device)
    final = S0.clone()
    for n, (start, length) in enumerate(bounds):
        tok = slice(start, start + length)
        out[:, tok], final[n:n + 1] = _token_loop(qn[:, tok], kn[:, tok], v[:, tok], a[:, tok],
                                                  b[:, tok], S0[n:n + 1], scale)
    return out, final


# ----------------------------------------------------------------------------------------------
# The chunked algorithm
# ----------------------------------------------------------------------------------------------


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

    def piece(x, s, e):
        return x[:, s:e]

    # pass 1: each segment's affine map, from [0; I]
    eye = torch.eye(K, dtype=dtype, device=device).expand(1, H, K, K)
    maps, o_zero, o_eye = [], [], []
    for s, e in spans:
        sub = {key: piece(x, s, e) for key, x in inter.items()}
        zero_v = torch.zeros(1, e - s, H, K, dtype=dtype, device=device)
        # the identity block follows the linear part only: it sees no values (v = 0)
        o_top, top = chunk_recurrence(sub, piece(v, s, e), chunk=chunk)
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
            sub = {key: piece(x, s, e) for key, x in inter.items()}
            out[:, s:e], _ = chunk_recurrence(sub, piece(v, s, e), chunk=chunk,
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


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """Round to bfloat16 and back (the operand precision of bf16 tensor-core products)."""
    return x.to(torch.bfloat16).to(x.dtype)


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to the 10-bit mantissa of tf32 (nearest, ties away) and back."""
    bits = x.float().view(torch.int32)
    bits = (bits + 0x1000) & ~0x1FFF
    return bits.view(torch.float32).to(x.dtype)


def rel_err(x, ref) -> float:
    """||x - ref|| / ||ref|| in float64 (on the CPU, so a device result can be compared to a host
    reference); inf if either holds NaN/Inf, so a broken result can never pass a tolerance."""
    x = torch.as_tensor(x).detach().to("cpu", torch.float64)
    ref = torch.as_tensor(ref).detach().to("cpu", torch.float64)
    if x.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ, x {tuple(x.shape)} vs ref {tuple(ref.shape)}")
    if not (torch.isfinite(x).all() and torch.isfinite(ref).all()):
        return math.inf
    num = torch.linalg.vector_norm(x - ref).item()
    den = torch.linalg.vector_norm(ref).item()
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den
