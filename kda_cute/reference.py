"""Kimi Delta Attention in plain torch: the ground truth and the chunked algorithm's debugging twin.

The math is in docs/kda.md. `kda_reference` is the float64 loop over tokens that every kernel is
tested against; the chunked algorithm, the kernels' phase-by-phase twin, is kda_cute.chunked.
`rel_err` is the one error measure the tests use.

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
