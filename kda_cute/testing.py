"""Shared by the GPU tests, the demo and the benchmark: random inputs like FlashKDA's benchmark,
poisoned outputs, and a run of kda_cute against the float64 reference (a CUDA device is needed)."""

from __future__ import annotations

import math

import torch

from kda_cute import DeviceValueError, check_errors, fwd
from kda_cute.plans.device import ready
from kda_cute.reference import kda_reference, rel_err

cuda_ready = ready  # (the GPU tests' gate and the self-test's)


def make_inputs(*, B=1, T=64, H=2, K=128, V=None, seqlens=None, gate="bounded", qk_l2norm=True,
                beta_sigmoid=True, state_dtype=torch.float32, init=True, seed=0, g_shift=0.0,
                token_stride_pad=0, device="cuda"):
    """Random inputs (never zeros). With `seqlens`, B must be 1 and T = sum(seqlens)."""
    V = V or K
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    if seqlens is not None:
        B, T = 1, int(sum(seqlens))
        cu = torch.tensor([0] + list(torch.tensor(seqlens).cumsum(0).tolist()), dtype=torch.int64,
                          device=device)
        N = len(seqlens)
    else:
        cu, N = None, B
    width = 3 * H * K + H * V + token_stride_pad
    # q, k, g, v sliced out of one packed projection when token_stride_pad > 0
    packed = randn(B, T, width).to(torch.bfloat16)
    q = packed[..., :H * K].view(B, T, H, K)
    k = packed[..., H * K:2 * H * K].view(B, T, H, K)
    g = (packed[..., 2 * H * K:3 * H * K].float() + g_shift).to(torch.bfloat16).view(B, T, H, K)
    v = packed[..., 3 * H * K:3 * H * K + H * V].view(B, T, H, V)
    if token_stride_pad == 0:
        q, k, g, v = (x.contiguous() for x in (q, k, g, v))
    else:
        g = packed[..., 2 * H * K:3 * H * K].view(B, T, H, K)
        g.add_(g_shift)
    beta = randn(B, T, H).to(torch.bfloat16)
    if not qk_l2norm:
        q = (q.float() / q.float().norm(dim=-1, keepdim=True)).to(torch.bfloat16)
        k = (k.float() / k.float().norm(dim=-1, keepdim=True)).to(torch.bfloat16)
    if not beta_sigmoid:
        beta = torch.sigmoid(beta.float()).to(torch.bfloat16)
    if gate == "none":
        g = (-torch.rand(B, T, H, K, generator=gen, device=device) * 2.0).to(torch.bfloat16)
    A_log = torch.rand(H, generator=gen, device=device)
    dt_bias = torch.rand(H, K, generator=gen, device=device)
    s0 = randn(N, H, V, K).to(state_dtype) if init else None
    d = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "A_log": A_log, "dt_bias": dt_bias,
         "initial_state": s0, "cu_seqlens": cu}
    d.update(scale=K ** -0.5, lower_bound=-5.0, gate=gate, qk_l2norm=qk_l2norm,
             beta_sigmoid=beta_sigmoid, N=N)
    return d


def run_kda(inp, *, final_dtype=torch.float32, in_place=False, cu_dtype=torch.int64,
            config=None, out_pad=0, segments=None, precision="fast"):
    """The forward on `inp` with NaN-poisoned outputs. out_pad > 0: `out` is row-strided (token
    stride H*V + out_pad) and the padding between its rows must stay untouched."""
    q, v = inp["q"], inp["v"]
    B, T, H, V = v.shape
    K = q.shape[3]
    buf = torch.full((B, T, H * V + out_pad), float("nan"), dtype=torch.bfloat16,
                     device=q.device)
    out = buf[..., :H * V].unflatten(-1, (H, V))
    init, final = inp["initial_state"], None
    if in_place:
        init = final = init.clone()
    elif final_dtype is not None:
        final = torch.full((inp["N"], H, V, K), float("nan"), dtype=final_dtype,
                           device=q.device)
    cu = inp["cu_seqlens"]
    if cu is not None:
        cu = cu.to(cu_dtype)
    fwd(q, inp["k"], v, inp["g"], inp["beta"], inp["scale"], out, inp["A_log"], inp["dt_bias"],
        inp["lower_bound"], init, final, cu, gate=inp["gate"], qk_l2norm=inp["qk_l2norm"],
        beta_sigmoid=inp["beta_sigmoid"], config=config, segments=segments, precision=precision)
    torch.cuda.synchronize()
    if out_pad and not bool(torch.isnan(buf[..., H * V:]).all()):
        raise AssertionError("out: the padding between rows was written")
    return out, final


def as_double(inp) -> dict:
    return {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            for n, t in inp.items()}


def reference(inp):
    """float64 ground truth, computed on the GPU (the loop is launch-bound, not FLOP-bound)."""
    d = as_double(inp)
    return kda_reference(d["q"], d["k"], d["v"], d["g"], d["beta"], scale=d["scale"],
                         initial_state=d["initial_state"], cu_seqlens=d["cu_seqlens"],
                         A_log=d["A_log"], dt_bias=d["dt_bias"], lower_bound=d["lower_bound"],
                         gate=d["gate"], qk_l2norm=d["qk_l2norm"],
                         beta_sigmoid=d["beta_sigmoid"])


def errors(inp, **kw) -> dict:
    out, final = run_kda(inp, **kw)
    ref_o, ref_s = reference(inp)
    res = {"out_err": rel_err(out, ref_o),
           "out_finite": bool(torch.isfinite(out.float()).all())}
    if final is not None:
        res["state_err"] = rel_err(final, ref_s)
        res["state_finite"] = bool(torch.isfinite(final.float()).all())
    return res


def token_rows(B, T, cu_seqlens, chunk) -> tuple[torch.Tensor, torch.Tensor]:
    """The workspace row of every token, and every row of the sequences' whole chunks (what K1
    writes: each sequence's tokens, then zeros to the end of its last chunk). A fixed-length
    batch packs its chunks; a varlen batch's sequence s starts at the slot chunk_slots gives."""
    if cu_seqlens is None:
        lens = [T] * B
        starts = [b * -(-T // chunk) for b in range(B)]
    else:
        from kda_cute.plans.workspace import chunk_slots

        cs = cu_seqlens.cpu().to(torch.int32)
        lens = torch.diff(cs).tolist()
        starts = chunk_slots(cs, chunk, torch.arange(len(cs), dtype=torch.int32)).tolist()
    rows, chunk_rows = [], []
    for n, slot in zip(lens, starts, strict=False):
        rows.append(slot * chunk + torch.arange(n))
        chunk_rows.append(slot * chunk + torch.arange(-(-n // chunk) * chunk))
    empty = torch.zeros(0, dtype=torch.long)
    return (torch.cat(rows) if rows else empty,
            torch.cat(chunk_rows) if chunk_rows else empty)


# ---------------------------------------------------------------- pools the GPU tests poison
SENTINEL = -0.0017  # a pool value no kernel writes by chance
GUARD = 4096  # elements of poisoned guard (777.0) on each side of a pool


def guarded(shape, dtype, fill=SENTINEL, pad=0, device="cuda"):
    """A tensor of `shape` filled with `fill` inside a buffer with GUARD poisoned elements on
    each side: (tensor, buffer). pad > 0: its rows (dim 0) lie `pad` elements further apart than
    their size (a pool's free slot stride; the gaps hold `fill` too)."""
    per = math.prod(shape[1:])
    n = shape[0] * (per + pad)
    buf = torch.full((n + 2 * GUARD,), fill, dtype=dtype, device=device)
    buf[:GUARD] = 777.0
    buf[-GUARD:] = 777.0
    inner = buf[GUARD:GUARD + n]
    if not pad:
        return inner.view(shape), buf
    return inner.view(shape[0], per + pad)[:, :per].unflatten(-1, tuple(shape[1:])), buf


def guards_ok(buf) -> bool:
    """The guard regions of a `guarded` buffer are untouched."""
    return bool((buf[:GUARD] == 777.0).all() and (buf[-GUARD:] == 777.0).all())


def bits(x):
    """A float tensor's bits as integers of its width (bit-for-bit comparisons, NaN included)."""
    return x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)


# ------------------------------------------------------ values past fp16's range, and after them
def scaled(inp, vmax=6e4, smax=1e4, heads=None, tokens=None):
    """inp with v scaled to max |v| = vmax (bf16 rounding aside) and the initial state to max
    |S0| = smax, in `heads` (all by default) and over `tokens` (a slice, all by default)."""
    v = inp["v"].float()
    sel = (slice(None), tokens if tokens is not None else slice(None),
           heads if heads is not None else slice(None))
    v[sel] = v[sel] * (vmax / float(v[sel].abs().max()))
    out = dict(inp, v=v.to(torch.bfloat16))
    s0 = inp["initial_state"]
    if s0 is not None and smax is not None:
        s = s0.float()
        hs = heads if heads is not None else slice(None)
        s[:, hs] = s[:, hs] * (smax / float(s[:, hs].abs().max()))
        out["initial_state"] = s.to(s0.dtype)
    return out


def clear_errors():
    """Waits for the device and drops any error a kernel reported, so that the next check sees
    only the next forward's."""
    torch.cuda.synchronize()
    try:
        check_errors(sync=True)
    except DeviceValueError:
        pass


# ----------------------------------------------------------- the GPU tests' bars and checks
# the forward's bars against float64, about twice the bf16 output's own rounding
OUT_TOL, STATE_TOL = 3.5e-3, 2.5e-3
STATE_TOL_BF16 = 6e-3  # a bf16 final state carries its own rounding


def assert_errors(res, out_tol=OUT_TOL, state_tol=STATE_TOL):
    """A run's errors (testing.errors) finite and within the bars."""
    assert res["out_finite"], res
    assert res["out_err"] < out_tol, res
    if "state_err" in res:
        assert res["state_finite"], res
        assert res["state_err"] < state_tol, res


def check_tokens_past_the_last_sequence(config):
    """cu_seqlens[-1] < T: the trailing tokens belong to no sequence. Their output rows stay
    untouched, and the workspace rows K1 never writes (poisoned with NaN bits here) must not leak
    into any sequence."""
    from kda_cute import api

    lens, pad = [20, 7, 33], 19
    full = make_inputs(seqlens=lens + [pad], H=2, K=128, seed=41)
    inp = dict(full, cu_seqlens=full["cu_seqlens"][:-1], N=len(lens),
               initial_state=full["initial_state"][:-1].contiguous())
    q, v = inp["q"], inp["v"]
    out = torch.full(v.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    final = torch.full_like(inp["initial_state"], float("nan"))
    args = (q, inp["k"], v, inp["g"], inp["beta"], inp["scale"], out, inp["A_log"],
            inp["dt_bias"], inp["lower_bound"], inp["initial_state"], final, inp["cu_seqlens"])
    p = api.validate(*args, "bounded")
    ws = torch.full((api.workspace_bytes(p, api.config_for(p, config)),), 0xFF,
                    dtype=torch.uint8, device="cuda")
    fwd(*args, ws, config=config)
    torch.cuda.synchronize()
    T = sum(lens)
    trimmed = {n: (t[:, :T] if n in ("q", "k", "v", "g", "beta") else t) for n, t in inp.items()}
    ref_o, ref_s = reference(trimmed)
    assert rel_err(out[:, :T], ref_o) < OUT_TOL
    assert rel_err(final, ref_s) < STATE_TOL
    assert torch.isnan(out[:, T:].float()).all(), "rows of no sequence were written"


def packed_batch(lens, H, K, V, seed=0, device="cpu", cu_dtype=torch.int64):
    """A packed batch of sequences of `lens` tokens (random bf16 q, k, v, g, beta [1, T, ...])
    with its cu_seqlens and float64 initial states [N, H, V, K] (scaled 0.3): the context-
    parallel tests' inputs."""
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(torch.bfloat16).to(device)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=cu_dtype)
    S0 = torch.randn(len(lens), H, V, K, generator=gen, dtype=torch.float64) * 0.3
    return (rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, V), rnd(1, T, H, K), rnd(1, T, H),
            cu, S0)


def free_port() -> int:
    """A free local TCP port for a process group's rendezvous."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
