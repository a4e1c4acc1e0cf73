"""Public entry points: `fwd` (FlashKDA-compatible) and `chunk_kda` (fla-compatible).

Every input is validated on the host (shapes, dtypes, devices, strides) before anything is
launched; a bad input raises ValueError / TypeError naming the argument, what was expected and what
was got. A launch itself does no host sync except the optional check of cu_seqlens' values.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
from dataclasses import dataclass, replace

import torch

from . import runtime, segments
from .abi import SYM_DIV
from .config import (
    ALONGSIDE_K1_PER_PAIR,
    GATE_MODES,
    K1_GRID_Y,
    PRECISIONS,
    SEGMENT_RUNS,
    FwdConfig,
    alongside_of,
    combine_config,
    select_config,
    supports,
    wy_of,
)

_STATE_CODE = {None: 0, torch.float32: 1, torch.bfloat16: 2}


def _err(name: str, expected: str, got) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {got}")


def _check_tensor(name, t, dtypes, ndim=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        exp = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name}: expected dtype {exp}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None and t.dim() != ndim:
        raise _err(name, f"a {ndim}-d tensor", f"shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise _err(name, f"a tensor on {device}", f"one on {t.device}")


def _check_shape(name, t, shape):
    if tuple(t.shape) != tuple(shape):
        raise _err(name, f"shape {tuple(shape)}", f"{tuple(t.shape)}")


def _capturing(dev) -> bool:
    if dev.type != "cuda":
        return False
    with torch.cuda.device(dev):
        return torch.cuda.is_current_stream_capturing()


def _check_device(name, t):
    if t.device.type != "cuda":
        raise _err(name, "a CUDA tensor", f"one on {t.device}")


@dataclass(frozen=True)
class Problem:
    B: int
    T: int
    H: int
    K: int
    V: int
    N: int  # sequences
    varlen: bool


def _check_rows(name, t, div: int | None):
    """[B, T, H, D] with D contiguous and heads packed; the token stride is free but rows must not
    overlap (a kernel reads and writes whole token rows)."""
    B, T, H, D = t.shape
    if t.stride(3) != 1 or (H > 1 and t.stride(2) != D):
        raise _err(name, f"the last two dims contiguous (strides (..., {D}, 1))",
                   f"strides {tuple(t.stride())}")
    if T > 1 and t.stride(1) < H * D:
        raise _err(name, f"a token stride >= H*D = {H * D} (rows must not overlap)",
                   f"strides {tuple(t.stride())}")
    if B > 1 and T > 0 and t.stride(0) != T * t.stride(1):
        raise _err(name, "batch stride == T * token stride", f"strides {tuple(t.stride())}")
    if div and (t.stride(1) % div or t.data_ptr() % 16):
        raise _err(name, f"token stride a multiple of {div} elements and a 16-byte aligned base",
                   f"stride {t.stride(1)}, address {t.data_ptr()}")


def _check_seqlens(cu_seqlens: torch.Tensor, T: int) -> None:
    """cu_seqlens' values: non-decreasing from 0 to at most T (a host sync)."""
    cs = cu_seqlens.cpu()
    if int(cs[0]) != 0 or bool((cs[1:] < cs[:-1]).any()) or int(cs[-1]) > T:
        raise _err("cu_seqlens", f"non-decreasing offsets from 0 to at most T={T}",
                   cs.tolist() if cs.numel() < 17 else f"{cs[:8].tolist()}...")


def validate(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
             final_state, cu_seqlens, gate, check_seqlens=True) -> Problem:
    _check_tensor("q", q, (torch.bfloat16,), 4)
    _check_device("q", q)
    dev = q.device
    B, T, H, K = q.shape
    for name, t in (("k", k), ("g", g)):
        _check_tensor(name, t, (torch.bfloat16,), 4, dev)
        _check_shape(name, t, (B, T, H, K))
    _check_tensor("v", v, (torch.bfloat16,), 4, dev)
    if tuple(v.shape[:3]) != (B, T, H):
        raise _err("v", f"shape ({B}, {T}, {H}, V)", f"{tuple(v.shape)}")
    V = v.shape[3]
    _check_tensor("beta", beta, (torch.bfloat16,), 3, dev)
    _check_shape("beta", beta, (B, T, H))
    if (H > 1 and beta.stride(2) != 1) or (T > 1 and beta.stride(1) < H) or (
            B > 1 and T > 0 and beta.stride(0) != T * beta.stride(1)):
        raise _err("beta", "heads contiguous, token stride >= H, batch stride == T * token "
                   "stride", f"strides {tuple(beta.stride())}")
    if out is not None:
        _check_tensor("out", out, (torch.bfloat16,), 4, dev)
        _check_shape("out", out, (B, T, H, V))
        _check_rows("out", out, SYM_DIV["sO"])
    for name, t in (("q", q), ("k", k), ("g", g), ("v", v)):
        _check_rows(name, t, SYM_DIV["s" + name.upper()])
    if not isinstance(gate, str) or gate not in GATE_MODES:
        raise _err("gate", f"one of {sorted(GATE_MODES)}", repr(gate))
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
            or not math.isfinite(scale) or scale <= 0):
        raise _err("scale", "a finite positive float", repr(scale))
    if gate == "bounded":
        if not isinstance(lower_bound, (int, float)) or not -5.0 <= lower_bound < 0.0:
            raise _err("lower_bound", "a float in [-5, 0) for the bounded gate", repr(lower_bound))
    if gate != "none":
        if A_log is None and gate == "unbounded":
            raise _err("A_log", "a float32 tensor [H] for the unbounded gate", None)
        if A_log is not None:
            _check_tensor("A_log", A_log, (torch.float32,), None, dev)
            if A_log.numel() != H or not A_log.is_contiguous():
                raise _err("A_log", f"a contiguous float32 tensor of {H} elements",
                           f"shape {tuple(A_log.shape)}")
        if dt_bias is not None:
            _check_tensor("dt_bias", dt_bias, (torch.float32,), None, dev)
            if dt_bias.numel() != H * K or not dt_bias.is_contiguous():
                raise _err("dt_bias", f"a contiguous float32 tensor [{H}, {K}] or [{H * K}]",
                           f"shape {tuple(dt_bias.shape)}")
    if cu_seqlens is not None:
        _check_tensor("cu_seqlens", cu_seqlens, (torch.int64, torch.int32), 1, dev)
        if B != 1:
            raise _err("q", "batch size 1 when cu_seqlens is given", f"batch size {B}")
        if cu_seqlens.numel() < 2:
            raise _err("cu_seqlens", "at least 2 entries [N+1]", f"{cu_seqlens.numel()}")
        N = cu_seqlens.numel() - 1
        if not cu_seqlens.is_contiguous():
            raise _err("cu_seqlens", "a contiguous tensor", f"strides {tuple(cu_seqlens.stride())}")
        if check_seqlens and not _capturing(dev):
            _check_seqlens(cu_seqlens, T)
    else:
        N = B
    for name, st in (("initial_state", initial_state), ("final_state", final_state)):
        if st is None:
            continue
        _check_tensor(name, st, (torch.float32, torch.bfloat16), 4, dev)
        _check_shape(name, st, (N, H, V, K))
        if not st.is_contiguous():
            raise _err(name, "a contiguous tensor", f"strides {tuple(st.stride())}")
    return Problem(B, T, H, K, V, N, cu_seqlens is not None)


def config_for(p: Problem, config: FwdConfig | None = None, precision: str = "fast"
               ) -> FwdConfig:
    """The forward config for problem `p`: `config` as given (checked), or the ladder's for
    `precision` ("fast" or "precise": config.select_config)."""
    if precision not in PRECISIONS:
        raise _err("precision", f"one of {PRECISIONS}", repr(precision))
    if config is not None:
        if not isinstance(config, FwdConfig):
            raise TypeError(f"config: expected a FwdConfig, got {type(config).__name__}")
        ok, why = supports(config)
        if not ok:
            raise _err("config", "a supported config", why)
        if (config.prep.head_dim_k, config.recur.head_dim_v) != (p.K, p.V):
            raise _err("config", f"head dims ({p.K}, {p.V})",
                       f"({config.prep.head_dim_k}, {config.recur.head_dim_v})")
        return config
    cfg = select_config(p.K, p.V, p.varlen, precision)
    if cfg is None:
        raise _err("q/v", "head dims (K, V) with a shipped config: (64, 64), (128, 128), "
                   "(256, 256)", f"K={p.K}, V={p.V}")
    return cfg


def _workspace_rows(p: Problem, chunk: int) -> tuple[int, int]:
    """(chunks, rows) the workspace holds: every sequence's chunks, whole (a sequence's last
    chunk padded to `chunk` rows, which K1 writes as zeros), B*T // chunk + N slots: a varlen
    batch's sequence s starts at slot cu_seqlens[s] // chunk + s (`chunk_slots`)."""
    nch = p.B * p.T // chunk + p.N
    return nch, nch * chunk


def _workspace_layout(p: Problem, cfg: FwdConfig) -> list[tuple[str, tuple, torch.dtype]]:
    """K1's outputs, in workspace order, one row per token slot of whole chunks: fp32 for the
    SIMT K2; for the tensor-core K2 its bf16 operands, kd, Aw and Mq as (hi, lo) planes."""
    C, H, K = cfg.chunk, p.H, p.K
    nch, R = _workspace_rows(p, C)
    f32, bf16 = torch.float32, torch.bfloat16
    # one int32 per (chunk slot, head): K1 flags the pair once written, for a K2 running
    # alongside it (_k2_alongside; zeroed before each such launch)
    flags = ("flags", (nch * H,), torch.int32)
    if cfg.prep.operands == "bf16":
        # the f16 configs: fp16 throughout, kd, Aw and Mq one plane each (no lo planes)
        h, planes = (torch.float16, 1) if cfg.prep.f16 else (bf16, 2)
        return [("qg", (R, H, K), h), ("kg", (R, H, K), h), ("kd", (planes, R, H, K), h),
                ("gl", (nch, H, K), f32), ("aw", (planes, R, H, C), h),
                ("mq", (planes, R, H, C), h), flags]
    return [("qg", (R, H, K), f32), ("kg", (R, H, K), f32), ("kd", (R, H, K), f32),
            ("gl", (nch, H, K), f32), ("aw", (R, H, C), f32), ("mq", (R, H, C), f32), flags]


_ELEM = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.int32: 4}


@functools.lru_cache(maxsize=1024)
def _workspace_plan(p: Problem, cfg: FwdConfig) -> tuple[tuple, int]:
    """((name, offset, bytes, shape, dtype), ...) from a 256-byte aligned base, and the bytes a
    workspace needs (one alignment's slack included)."""
    plan, start = [], 0
    for name, shape, dtype in _workspace_layout(p, cfg):
        n = math.prod(shape) * _ELEM[dtype]
        plan.append((name, start, n, shape, dtype))
        start += (n + 255) // 256 * 256
    return tuple(plan), start + 256


def workspace_bytes(p: Problem, cfg: FwdConfig) -> int:
    """Bytes of the caller-ownable workspace: K1's outputs, each 256-byte aligned."""
    return _workspace_plan(p, cfg)[1]


def workspace_views(workspace: torch.Tensor, p: Problem, cfg: FwdConfig) -> dict:
    """K1's outputs as typed views into the workspace (each 256-byte aligned)."""
    base = (-workspace.data_ptr()) % 256
    return {name: workspace[base + off:base + off + n].view(dtype).view(shape)
            for name, off, n, shape, dtype in _workspace_plan(p, cfg)[0]}


def chunk_slots(cu_seqlens: torch.Tensor, chunk: int, ramp: torch.Tensor,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Each varlen sequence's first workspace chunk slot (cu_chunks), cu_seqlens[s] // chunk +
    s (`ramp` = 0, 1, ..., N): no prefix sum over the lengths, so two small kernels, and every
    sequence's slots begin past the previous one's last chunk (floor((a + n) / C) - floor(a / C)
    + 1 >= ceil(n / C) slots for n tokens). The slots between (at most one a sequence) hold no
    tokens: K1 skips them, K2 never reads them. A fixed-length batch packs its chunks instead
    (_segment_offsets). `out`: an int32 tensor [N + 1] to write them into."""
    return torch.div(cu_seqlens, chunk, rounding_mode="floor", out=out).add_(ramp)


def _offsets(p: Problem, cfg: FwdConfig, cu_seqlens, dev, plan=None):
    """int32 cu_seqlens and cu_chunks on the device, without a host sync (a fixed-length
    batch: its sequences as one segment each, made once per shape). A varlen forward being
    recorded (`plan`) keeps the tensors they are written into, and each replay refills them
    from that call's cu_seqlens (_VarlenOffsets)."""
    if cu_seqlens is None:
        return _segment_offsets(p.B, p.T, cfg.chunk, 1, dev)
    offsets = _VarlenOffsets(cu_seqlens, cfg.chunk, _ramp(p.N + 1, dev))
    if plan is not None:
        plan.offsets = offsets
    return offsets(cu_seqlens)


class _VarlenOffsets:
    """A varlen forward's int32 cu_seqlens (int64 ones copied into a tensor of its own) and
    cu_chunks, which its launches read; a recorded forward's are refilled from each call's
    cu_seqlens, on the stream, before the launches (a stream runs its forwards in order)."""

    def __init__(self, cu_seqlens: torch.Tensor, chunk: int, ramp: torch.Tensor):
        self.chunk, self.ramp = chunk, ramp
        self.cs = (None if cu_seqlens.dtype == torch.int32
                   else torch.empty(cu_seqlens.shape, dtype=torch.int32, device=ramp.device))
        self.cc = torch.empty(cu_seqlens.shape, dtype=torch.int32, device=ramp.device)

    def __call__(self, cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = cu_seqlens if self.cs is None else self.cs.copy_(cu_seqlens)
        return cs, chunk_slots(cs, self.chunk, self.ramp, out=self.cc)


_ramps: dict[tuple, torch.Tensor] = {}


def _ramp(n: int, dev) -> torch.Tensor:
    """0, 1, ..., n - 1 (int32) on a device, made once per length; nothing writes it. Its own
    cache: varlen batches of many sizes must not push out the segments' large constants."""
    return _cached(_ramps, (n, dev), dev, lambda: torch.arange(n, dtype=torch.int32, device=dev))


@functools.lru_cache(maxsize=16)
def _sm_budget(device: int) -> tuple[int, int, int]:
    """(SMs, shared memory per SM, the most one CTA may reserve) of a device, in bytes."""
    prop = torch.cuda.get_device_properties(device)
    return (prop.multi_processor_count,
            getattr(prop, "shared_memory_per_multiprocessor", 233472),
            getattr(prop, "shared_memory_per_block_optin", 232448))


# an SM hands out shared memory to a CTA in whole units of this many bytes (its launch request
# plus the 1 KB the system reserves per CTA)
SMEM_UNIT = 128


def _smem_unit(nbytes: int) -> int:
    """A CTA's shared memory as the SM allocates it: rounded up to whole SMEM_UNITs."""
    return -(-nbytes // SMEM_UNIT) * SMEM_UNIT


def _resident_per_sm(device: int, kernel) -> int:
    """A kernel's CTAs one SM holds at once: the fewest that its shared memory, its registers
    (allocated per warp in units of 256) and its threads allow."""
    _, per_sm, _ = _sm_budget(device)
    threads = kernel.block[0]
    regs = -(-int(kernel.manifest["registers"]) * 32 // 256) * 256 * -(-threads // 32)
    return max(1, min(per_sm // _smem_unit(kernel.smem + 1024), 65536 // regs,
                      2048 // threads))


def _k2_resident(device: int, k2) -> int:
    """K2 CTAs resident at once on the device."""
    return _sm_budget(device)[0] * _resident_per_sm(device, k2)


def _segment_count(p: Problem, cfg: FwdConfig, k2, device: int, requested) -> int:
    """Segments per sequence for K2 (1: the plain recurrence). Fixed-length batches with K == V
    only (the identity run reuses K2's config); `requested` (an int) overrides the choice."""
    if p.varlen or p.K != p.V or cfg.recur.mma != "wgmma" or p.B * p.T == 0:
        return 1
    if requested is not None:
        return max(1, min(int(requested), -(-p.T // cfg.chunk)))
    return segments.choose(p.B, p.T, p.H, p.V, cfg.chunk, cfg.recur.block_v,
                           _sm_budget(device)[0], _k2_resident(device, k2))


_seg_offsets: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _remember(cache: dict, key, value, dev) -> None:
    """Cache a tensor made on `dev`, unless its stream is being captured: a captured kernel
    runs only when the graph is replayed, so the tensor would hold garbage until then."""
    if _capturing(dev):
        return
    if len(cache) >= 16:
        cache.clear()
    cache[key] = value


def _cached(cache: dict, key, dev, make):
    """cache[key], made by make() on a miss and kept as _remember allows."""
    hit = cache.get(key)
    if hit is None:
        hit = make()
        _remember(cache, key, hit, dev)
    return hit


def _segment_offsets(B: int, T: int, C: int, P: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """segments.plan's offsets, built on the device (no host copy, so it can be graph-captured)
    once per shape and device; nothing writes them."""
    def make():
        nc = -(-T // C)
        cps = max(1, -(-nc // P))
        idx = torch.arange(B * P, device=dev, dtype=torch.int32)
        b, j = idx // P, idx % P
        c1 = torch.clamp((j + 1) * cps, max=nc)
        cu = torch.zeros(B * P + 1, device=dev, dtype=torch.int32)
        cc = torch.zeros_like(cu)
        cu[1:] = b * T + torch.clamp(c1 * C, max=T)
        cc[1:] = b * nc + c1
        return cu, cc

    return _cached(_seg_offsets, (B, T, C, P, dev), dev, make)


def launch_forward(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
                   final_state, cu_seqlens, workspace, gate, qk_l2norm, beta_sigmoid, p, cfg,
                   run_recurrence=True, segments_per_seq=None, plan=None):
    """Launch K1 then K2 on the current stream. Returns the workspace views K1 wrote when
    `run_recurrence` is False (K1 alone, for tests), else None. When few (sequence, head) pairs
    would leave SMs idle, K2 runs over segments of each sequence (kda_cute.segments); an int
    `segments_per_seq` forces the count (1: never). `plan` (a _Plan, with runtime.recording
    around the call) collects the tensors the launches use that the caller did not pass, and
    is marked not replayable where the forward does more than its kernel launches."""
    dev = q.device
    di = dev.index if dev.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(dev).cuda_stream
    if plan is not None:
        plan.stream, plan.device = stream, di  # where a replay's alongside order runs
    arch = runtime.arch_of(di)
    k1 = runtime.get_kernel(cfg.prep, arch)
    k2 = runtime.get_kernel(cfg.recur, arch)
    C, H, K, V = cfg.chunk, p.H, p.K, p.V
    Tt = p.B * p.T
    nch, R = _workspace_rows(p, C)
    need = workspace_bytes(p, cfg)
    if workspace is None:
        workspace = torch.empty(need, dtype=torch.uint8, device=dev)
        _Plan.refuse(plan)  # a fresh allocation each call
    elif (workspace.dtype != torch.uint8 or workspace.device != dev or workspace.numel() < need
          or not workspace.is_contiguous()):
        raise _err("workspace", f"a contiguous uint8 CUDA tensor of >= {need} bytes on {dev}",
                   f"{workspace.dtype} [{workspace.numel()}] on {workspace.device}")
    layout = _workspace_plan(p, cfg)[0]
    base = workspace.data_ptr()
    base += (-base) % 256
    # K1's outputs = K2's operands, by argument name: each tensor, and for bf16 operands the
    # hi and lo planes of kd, Aw and Mq (two equal planes, lo after hi; the f16 configs have
    # one, which their kernels read and write as hi only: lo names the same plane)
    ws = {name: base + off for name, off, *_ in layout}
    for name, off, n, shape, _ in layout:
        if name in ("kd", "aw", "mq"):
            ws[name + "h"] = base + off
            ws[name + "l"] = base + off + n // shape[0] * (shape[0] - 1)
    cs, cc = _offsets(p, cfg, cu_seqlens, dev, plan)
    if A_log is None:
        A_log = _constant("zeros", (H,), torch.float32, dev)
    if dt_bias is None:
        dt_bias = _constant("zeros", (H * K,), torch.float32, dev)
    _Plan.hold(plan, cs, cc, A_log, dt_bias)
    syms = {"T": Tt, "R": R, "H": H, "HK": H * K, "HV": H * V, "HC": H * C, "NCH": nch,
            "N1": p.N + 1, "NS": p.N, "sQ": q.stride(1), "sK": k.stride(1), "sG": g.stride(1),
            "sB": beta.stride(1), "sV": v.stride(1), "sO": out.stride(1), "sS": H * V * K,
            "sW": H * K, "sWc": H * C, "FL": nch * H}
    P, alongside, k2_grid = (_schedule(p, cfg, k2, di, segments_per_seq) if run_recurrence
                             else (1, False, None))
    if Tt > 0 and H > 0:
        vals1 = {"q": q.data_ptr(), "k": k.data_ptr(), "g": g.data_ptr(),
                 "beta": beta.data_ptr(), "A_log": A_log.data_ptr(),
                 "dt_bias": dt_bias.data_ptr(), "cu_seqlens": cs.data_ptr(),
                 "cu_chunks": cc.data_ptr(), **ws, "num_seqs": p.N,
                 "seq_len": 0 if p.varlen else p.T, "num_chunks": nch, "num_heads": H,
                 "scale": float(scale), "lower_bound": float(lower_bound or 0.0),
                 "gate_mode": GATE_MODES[gate], "qk_l2norm": int(bool(qk_l2norm)),
                 "beta_sigmoid": int(bool(beta_sigmoid))}
    k1_grid = (H, min(nch, K1_GRID_Y), -(-nch // K1_GRID_Y))  # heads fastest; chunks on y, z
    if not run_recurrence or not alongside:
        if Tt > 0 and H > 0:
            k1.launch_with(k1_grid, vals1, syms, stream, di)
        if not run_recurrence:
            return workspace_views(workspace, p, cfg)
    dummy = out.data_ptr()
    s_in = _STATE_CODE[initial_state.dtype if initial_state is not None else None]
    s_out = _STATE_CODE[final_state.dtype if final_state is not None else None]
    sp_in = initial_state.data_ptr() if initial_state is not None else dummy
    sp_out = final_state.data_ptr() if final_state is not None else dummy
    vals2 = {**ws, "v": v.data_ptr(), "out": out.data_ptr(), "out_tma": out.data_ptr(),
             "s0f": sp_in, "s0h": sp_in, "s1f": sp_out, "s1h": sp_out,
             "cu_seqlens": cs.data_ptr(), "cu_chunks": cc.data_ptr(), "num_seqs": p.N,
             "num_heads": H, "state_in": s_in, "state_out": s_out,
             "ordered": int(_longest_first(p, k2, k2_grid, di))}
    if alongside:
        if plan is not None:
            plan.alongside = True  # its replay runs in _alongside_order too
        # the alongside builds: K2 first, alone on its SMs (its shared memory padded to a whole
        # SM's), waiting on K1's per-chunk flags; K1 as its programmatic dependent on the SMs
        # left, held to _k1_alongside_ctas CTAs per SM (padded shared memory)
        acfg = alongside_of(cfg)
        k1a, k2a = runtime.get_kernel(acfg.prep, arch), runtime.get_kernel(acfg.recur, arch)
        k1a.load(di)  # a first load would wait for K2, which waits for K1
        ctas = _k1_alongside_ctas(p, math.prod(k2_grid), di, k1a)
        with _alongside_order(di, stream, not _capturing(dev)):
            runtime.recorded(runtime.memset_d32, ws["flags"], 0, nch * H, stream)
            k2a.launch_with(k2_grid, vals2, syms, stream, di, smem=_sm_budget(di)[2])
            k1a.launch_with(k1_grid, vals1, syms, stream, di, programmatic=True,
                            smem=_k1_alongside_smem(di, ctas))
    elif P > 1:
        _segmented_recurrence(k2, cfg, vals2, syms, p, P, v, initial_state, final_state,
                              stream, di, plan)
    elif k2_grid is not None:
        _k2_serial(cfg, k2, k2_grid, di, arch).launch_with(k2_grid, vals2, syms, stream, di)
    return None


def _k2_serial(cfg: FwdConfig, k2, k2_grid: tuple, device: int, arch: str):
    """The K2 of a serial forward: its WY-form build (config.WY_RUNS) where every CTA has an
    SM to itself (the grid within one CTA per SM, or a kernel that holds one per SM), the
    plain one otherwise. Measured on the H200 (bench/NOTES.md): K2 -6% at K = 128 B1 T8192
    H64 and -5% at K = 256; slower where two CTAs share an SM. KDA_CUTE_WY=0 turns it off,
    KDA_CUTE_WY=force takes it wherever one is built (for measuring)."""
    w = wy_of(cfg.recur)
    mode = os.environ.get("KDA_CUTE_WY", "1")
    if w is None or mode == "0":
        return k2
    if (mode == "force" or math.prod(k2_grid) <= _sm_budget(device)[0]
            or _resident_per_sm(device, k2) == 1):
        return runtime.get_kernel(w, arch)
    return k2


def _longest_first(p: Problem, k2, k2_grid, device: int) -> bool:
    """Whether K2's grid z takes the sequences longest first (the kernel ranks them from
    cu_seqlens): a varlen batch of 2 .. threads - 1 sequences whose K2 grid needs more than one
    wave. Its CTAs are dispatched about in grid order, so a long sequence that comes last in
    cu_seqlens would otherwise start last and run on alone at the end."""
    return (p.varlen and 2 <= p.N < k2.block[0] and k2_grid is not None
            and math.prod(k2_grid) > _k2_resident(device, k2))


# per device: (the stream of the last alongside forward launched, an event recorded after it)
_alongside_last: dict[int, tuple[int, int]] = {}
_alongside_lock = threading.Lock()


@contextlib.contextmanager
def _alongside_order(device: int, stream: int, enabled: bool):
    """Around an alongside forward's launches: alongside forwards on different streams must not
    run at once (each K2 grid holds up to half of the SMs while it waits for its K1, so two can
    leave K1 none: a hang, ended by K2's trap). One launched on another stream than the last
    waits (on the device, not the host) for that one's end; then an event marks its own end
    (one event per device, reused: a wait takes its last record at the time of the wait). The
    lock keeps host threads launching at once in order. Off during capture: a captured stream
    cannot wait on an event recorded outside it (graphs replayed at once on several streams
    are not covered)."""
    if not enabled:
        yield
        return
    with _alongside_lock:
        last = _alongside_last.get(device)
        if last is not None and last[0] != stream:
            runtime.wait_event(stream, last[1])
        yield
        event = last[1] if last is not None else runtime.new_event()
        runtime.record_event(event, stream)
        _alongside_last[device] = (stream, event)


def schedule(p: Problem, cfg: FwdConfig, device: int, segments=None) -> str:
    """How a forward of problem `p` runs K2 on `device`: "alongside" (K2 first, K1 beside it),
    "segments P" (K2 over P segments of each sequence, then the combine) or "serial" (K1, then
    K2). Loads K2's cubin (its shared memory and registers decide)."""
    k2 = runtime.get_kernel(cfg.recur, runtime.arch_of(device))
    P, alongside, _ = _schedule(p, cfg, k2, device, segments)
    return "alongside" if alongside else f"segments {P}" if P > 1 else "serial"


def _schedule(p: Problem, cfg: FwdConfig, k2, device: int, segments_per_seq):
    """(segments per sequence, K2 alongside K1, K2's grid or None when K2 has no work)."""
    if p.N == 0 or p.H == 0:
        return 1, False, None
    P = _segment_count(p, cfg, k2, device, segments_per_seq)
    nz = p.N
    if not p.varlen and cfg.recur.mma == "wgmma":
        nz = -(-p.N // k2_seqs_per_cta(p.N, p.V // cfg.recur.block_v * p.H,
                                       _k2_resident(device, k2)))
    grid = (p.V // cfg.recur.block_v, p.H, nz)
    alongside = (P == 1 and p.B * p.T >= ALONGSIDE_MIN_CHUNKS * cfg.chunk * p.N
                 and _k2_alongside(cfg, grid, device))
    return P, alongside, grid


# K2 runs alongside K1 only where the sequences average at least this many chunks (shorter
# ones, decode above all, would pay the flags' memset and gain nothing)
ALONGSIDE_MIN_CHUNKS = 32


def _k1_alongside_ctas(p: Problem, k2_ctas: int, device: int, k1) -> int:
    """K1 CTAs per SM alongside K2: ALONGSIDE_K1_PER_PAIR per (sequence, head) pair per SM left
    to K1, at least one, at most what fits."""
    free = max(1, _sm_budget(device)[0] - k2_ctas)
    want = round(ALONGSIDE_K1_PER_PAIR[p.K] * p.N * p.H / free)
    return max(1, min(want, _resident_per_sm(device, k1)))


def _k1_alongside_smem(device: int, ctas: int) -> int:
    """The shared memory reservation that holds K1 to `ctas` CTAs per SM (the launch takes
    the kernel's own where that is more)."""
    return _sm_budget(device)[1] // ctas // SMEM_UNIT * SMEM_UNIT - 1024


def _k2_alongside(cfg: FwdConfig, k2_grid: tuple, device: int) -> bool:
    """Whether K2 runs alongside K1 rather than after it: where K2's grid (one CTA per SM)
    takes at most half of the SMs, so K1 keeps the other half and K2 consumes each chunk as
    K1 flags it (the tensor-core forwards with an alongside build, config.ALONGSIDE). K2 is
    then launched first and every one of its CTAs is resident before K1 starts (K1 is its
    programmatic dependent), so its waits always end. Measured on the H200 (bench/NOTES.md,
    K1 held to _k1_alongside_ctas): B1 T8192 H32 -20% at K = 128 and 64; K2's steps
    are still ~15% slower than alone (K1's memory traffic), so it pays only where K2 leaves SMs
    idle. KDA_CUTE_ALONGSIDE=0 turns it off."""
    if (alongside_of(cfg) is None
            or os.environ.get("KDA_CUTE_ALONGSIDE", "1") == "0"):
        return False
    sms = _sm_budget(device)[0]
    return math.prod(k2_grid) <= sms // 2


@functools.lru_cache(maxsize=256)
def k2_seqs_per_cta(num_seqs: int, ctas_per_seq: int, slots: int) -> int:
    """Sequences each tensor-core K2 CTA runs one after another (CTA z: z, z + grid z, ...):
    the most that keep the waves as short, counted in sequences per resident CTA slot, as one
    per CTA does, so fewer CTAs start and fill their pipelines. Fixed-length batches only: with
    unequal lengths a CTA could collect several long ones."""
    def waves(n):
        return -(-ctas_per_seq * -(-num_seqs // n) // slots) * n

    best = waves(1)
    return max(n for n in range(1, min(num_seqs, 64) + 1) if waves(n) == best)


_constants: dict[tuple, torch.Tensor] = {}


def _constant(kind: str, shape: tuple, dtype, dev) -> torch.Tensor:
    """A zero tensor or a stack of identities, made once per shape and device (K2's identity
    run reads them; nothing writes them)."""
    def make():
        if kind == "zeros":
            return torch.zeros(shape, dtype=dtype, device=dev)
        return torch.eye(shape[-1], dtype=dtype, device=dev).expand(shape).contiguous()

    return _cached(_constants, (kind, shape, dtype, dev), dev, make)


_scratches: dict[tuple, torch.Tensor] = {}


def _scratch(shape: tuple, dtype, dev, stream: int) -> torch.Tensor:
    """A tensor K2's segment runs write and read within one forward, made once per shape,
    device and stream: forwards on one stream run in order, so each finishes with it before
    the next starts."""
    return _cached(_scratches, (shape, dtype, dev, stream), dev,
                   lambda: torch.empty(shape, dtype=dtype, device=dev))


class _Plan:
    """A forward's launches as recorded (runtime.recording), to be replayed by a later call
    with the same arguments (`fwd`), and the tensors they use beyond the caller's (held here,
    so a replay never reads freed memory). `ok` is False where the forward does more than its
    launches and the memset beside them (torch work around the combine, an allocated
    workspace): such a forward is never replayed. `offsets`: a varlen forward's
    (_VarlenOffsets), refilled from the call's cu_seqlens first. `alongside`: replayed within
    _alongside_order, as launched."""

    __slots__ = ("steps", "held", "ok", "offsets", "alongside", "stream", "device")

    def __init__(self):
        self.steps, self.held, self.ok, self.offsets, self.alongside = [], [], True, None, False

    def replay(self, cu_seqlens=None) -> None:
        if self.offsets is not None:
            self.offsets(cu_seqlens)
        with _alongside_order(self.device, self.stream, self.alongside):
            runtime.replay(self.steps)

    @staticmethod
    def hold(plan, *tensors) -> None:
        if plan is not None:
            plan.held.extend(t for t in tensors if t is not None)

    @staticmethod
    def refuse(plan) -> None:
        if plan is not None:
            plan.ok = False


# fwd's recorded forwards, by everything that decides their launches (_plan_key)
_plans: dict[tuple, _Plan] = {}
_PLANS_MAX = 64


def _tensor_key(t):
    """What of a tensor argument its launches depend on (None for None)."""
    if t is None:
        return None
    return t.data_ptr(), t.shape, t.stride(), t.dtype, t.device


def _plan_key(tensors: tuple, options: tuple):
    """The key of a fwd call's plan: each tensor's address, shape, strides, dtype and device,
    the scalar options with their types, the stream, and the switches read from the
    environment. None where no plan is kept: no caller-owned workspace, stream capture,
    arguments that are not tensors (the full path then raises the error), or
    KDA_CUTE_REPLAY=0. cu_seqlens' values are not in the key: a replay recomputes what
    depends on them (_VarlenOffsets) and checks them as the full path does."""
    q, workspace = tensors[0], tensors[-1]
    if (workspace is None or not isinstance(q, torch.Tensor)
            or os.environ.get("KDA_CUTE_REPLAY") == "0"):
        return None
    try:
        dev = q.device
        if _capturing(dev):
            return None
        key = (tuple(_tensor_key(t) for t in tensors),
               tuple((type(o), o) for o in options),
               torch.cuda.current_stream(dev).cuda_stream,
               os.environ.get("KDA_CUTE_WY"), os.environ.get("KDA_CUTE_ALONGSIDE"))
    except (AttributeError, TypeError, ValueError, RuntimeError):
        return None
    return key


def clear_caches() -> None:
    """Forget the recorded forwards and drop the device tensors the launcher keeps (offsets,
    zeros and identities, the segments' scratch states): the next calls make them again."""
    for cache in (_plans, _scratches, _constants, _seg_offsets, _ramps):
        cache.clear()


@functools.lru_cache(maxsize=64)
def _segment_run_configs(recur, K: int) -> tuple:
    """K2's configs for the segment runs (made once, not per call): the output-free variant,
    and the identity run's (V = K) with and without outputs."""
    quiet = replace(recur, outputs=False)
    return quiet, replace(quiet, head_dim_v=K), replace(recur, head_dim_v=K)


def _segmented_recurrence(k2, cfg, vals2, syms, p, P, v, initial_state, final_state,
                          stream, di, plan=None):
    """K2 over B * P segments (kda_cute.segments): the value rows from zero (end states B_j),
    the identity rows with v = 0 (state maps A_j), the combine (start states and the final
    state), then the value rows again from each segment's start state, writing `out`. The
    first two runs' outputs are not needed: they run K2's output-free variant
    (config.SEGMENT_RUNS) where one is built for this config. Their scratch tensors are
    kept per shape, device and stream (a stream runs its forwards in order)."""
    dev = v.device
    B, T, H, K, V = p.B, p.T, p.H, p.K, p.V
    C, bv, N = cfg.chunk, cfg.recur.block_v, p.B * P
    f32 = torch.float32
    cu, cc = _segment_offsets(B, T, C, P, dev)
    # the end states, the state maps and the combine's start states: one allocation (V == K)
    states = _scratch((3, N, H, K, K), f32, dev, stream)
    ends, maps, starts = states.unbind(0)
    zeros = _constant("zeros", (B * T, H, K), torch.bfloat16, dev)
    eye = _constant("eye", (N, H, K, K), f32, dev)
    arch = runtime.arch_of(di)
    quiet, ident_quiet, ident = _segment_run_configs(cfg.recur, K)
    k2z = runtime.get_kernel(quiet, arch) if quiet in SEGMENT_RUNS else k2
    # without the output-free variant the value run writes `out` (overwritten by the third
    # run) and the identity run a scratch tensor; with it they write nothing
    ident_out = None if k2z is not k2 else _scratch((B * T, H, K), torch.bfloat16, dev, stream)
    scratch = vals2["out"] if ident_out is None else ident_out.data_ptr()
    _Plan.hold(plan, cu, cc, states, zeros, eye, ident_out)
    seg = {"cu_seqlens": cu.data_ptr(), "cu_chunks": cc.data_ptr(), "num_seqs": N}
    syms_v = {**syms, "N1": N + 1, "NS": N}
    k2z.launch_with((V // bv, H, N), {**vals2, **seg, "state_in": 0, "state_out": 1,
                                      "s1f": ends.data_ptr(), "s1h": ends.data_ptr()},
                    syms_v, stream, di)
    k2i = runtime.get_kernel(ident_quiet if k2z is not k2 else ident, arch)
    syms_i = {**syms_v, "HV": H * K, "sV": H * K, "sO": H * K, "sS": H * K * K}
    k2i.launch_with((K // bv, H, N), {**vals2, **seg, "v": zeros.data_ptr(),
                                      "out": scratch, "out_tma": scratch,
                                      "state_in": 1, "s0f": eye.data_ptr(),
                                      "s0h": eye.data_ptr(), "state_out": 1,
                                      "s1f": maps.data_ptr(), "s1h": maps.data_ptr()},
                    syms_i, stream, di)
    starts = _combine(maps, ends, starts, initial_state, final_state, B, P, H, K, stream, di,
                      plan)
    k2.launch_with((V // bv, H, N), {**vals2, **seg, "state_in": 1,
                                     "s0f": starts.data_ptr(), "s0h": starts.data_ptr(),
                                     "state_out": 0},
                   syms_v, stream, di)


def _combine(maps, ends, starts, initial_state, final_state, B, P, H, K, stream, di,
             plan=None):
    """The segments' start states [B * P, H, K, K] (fp32, into `starts`) from their maps and
    end states, and the final state: one launch of the combine kernel
    (kernels/kda_combine_sm90.py), or segments.combine's batched products for a head dim
    without one."""
    cfg = combine_config(K)
    if (cfg is None or (initial_state is not None and initial_state.dtype != torch.float32)
            or (final_state is not None and final_state.dtype != torch.float32)):
        _Plan.refuse(plan)  # torch work beside the launches
    if cfg is None:
        st, final = segments.combine(maps.view(B, P, H, K, K), ends.view(B, P, H, K, K),
                                     initial_state, final_state)
        if final_state is not None and final is not final_state:
            final_state.copy_(final)
        return starts.copy_(st.view(B * P, H, K, K))
    kc = runtime.get_kernel(cfg, runtime.arch_of(di))
    s0 = initial_state
    if s0 is not None and s0.dtype != torch.float32:
        s0 = s0.float()
    final = final_state
    if final is not None and final.dtype != torch.float32:
        final = torch.empty(final.shape, dtype=torch.float32, device=final.device)
    dummy = starts.data_ptr()
    vals = {"maps": maps.data_ptr(), "ends": ends.data_ptr(),
            "s0": s0.data_ptr() if s0 is not None else dummy, "starts": starts.data_ptr(),
            "final": final.data_ptr() if final is not None else dummy, "segments": P,
            "has_init": int(s0 is not None), "has_final": int(final is not None)}
    kc.launch_with((K // cfg.rows, H, B), vals, {"NSP": B * P, "NS": B, "H": H, "sS": H * K * K},
                   stream, di)
    if final is not final_state:
        final_state.copy_(final)
    return starts


def fwd(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state=None,
        final_state=None, cu_seqlens=None, workspace=None, *, gate="bounded", qk_l2norm=True,
        beta_sigmoid=True, check_seqlens=True, config=None, segments=None, precision="fast"):
    """KDA forward, FlashKDA's low-level call: writes `out` and `final_state` in place.

    q, k, g: [B, T, H, K] bf16; v, out: [B, T, H, V] bf16; beta: [B, T, H] bf16 (logits when
    beta_sigmoid); A_log: [H] fp32; dt_bias: [H, K] fp32 or None; lower_bound in [-5, 0) for the
    bounded gate. gate: "bounded" (FlashKDA / Kimi-K3), "unbounded" (-exp(A_log) softplus(g +
    dt_bias), Kimi-Linear) or "none" (g is already the log-space decay). initial_state /
    final_state: [N, H, V, K] fp32 or bf16, may be the same tensor. cu_seqlens: [N+1] int64/int32
    with B == 1. workspace: optional caller-owned uint8 CUDA tensor (see `workspace_bytes`).
    config: a FwdConfig to use instead of the ladder's choice (kernel development, sweeps).
    precision: the ladder's choice between "fast" (K2's products on fp16 operands: fp32 state
    within ~4e-4 of float64, values up to ~1e4 in magnitude) and "precise" (bf16 hi/lo
    products: ~5e-6, bf16's range; ~15% slower at K = 128).
    segments: K2's segments per sequence (kda_cute.segments; fixed-length batches, K == V);
    None chooses from the grid's size, 1 turns them off. Where K2's grid is small and not
    split, K2 runs alongside K1 (`schedule`; KDA_CUTE_ALONGSIDE=0 turns that off).
    With a workspace, a call with the same tensors, options and stream as an earlier one
    replays that call's launches (_Plan; a varlen call's offsets are recomputed from its
    cu_seqlens); KDA_CUTE_REPLAY=0 turns that off, `clear_caches` forgets them.
    """
    if out is None:
        raise _err("out", "a bf16 tensor [B, T, H, V] to write", None)
    if segments is not None and (isinstance(segments, bool) or not isinstance(segments, int)
                                 or segments < 1):
        raise _err("segments", "None or an int >= 1", repr(segments))
    # a repeated call (same tensors, options and stream: a serving loop's fixed buffers)
    # replays the launches recorded the first time: every check and choice made then holds
    key = _plan_key((q, k, v, g, beta, out, A_log, dt_bias, initial_state, final_state,
                     cu_seqlens, workspace),
                    (scale, lower_bound, gate, qk_l2norm, beta_sigmoid, config, segments,
                     precision))
    plan = None
    if key is not None:
        try:
            plan = _plans.get(key)
        except TypeError:  # an unhashable option: the full path names it
            key = None
    if plan is not None:
        if plan.ok:
            if cu_seqlens is not None and check_seqlens:
                _check_seqlens(cu_seqlens, q.shape[1])
            with torch.cuda.device(q.device):
                plan.replay(cu_seqlens)
            return
        key = None  # not replayable (found on the first call): the full path, not recorded
    p = validate(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
                 final_state, cu_seqlens, gate, check_seqlens)
    cfg = config_for(p, config, precision)
    plan = _Plan() if key is not None else None
    # the kernel handles and the stream belong to q's device, whatever device is current
    with torch.cuda.device(q.device), runtime.recording() as steps:
        launch_forward(q, k, v, g, beta, scale, out, A_log, dt_bias, lower_bound, initial_state,
                       final_state, cu_seqlens, workspace, gate, qk_l2norm, beta_sigmoid, p, cfg,
                       segments_per_seq=segments, plan=plan)
    if plan is not None:
        if plan.ok:
            plan.steps = steps
        else:
            plan.held = []  # kept only as the mark: the full path each call
        if len(_plans) >= _PLANS_MAX:
            _plans.clear()
        _plans[key] = plan


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
              use_beta_sigmoid_in_kernel=False, safe_gate=False, lower_bound=None, A_log=None,
              dt_bias=None, state_v_first=False, cu_seqlens=None, workspace=None,
              precision="fast", **kwargs):
    """fla-compatible forward: returns (o, final_state or None).

    State layout is [N, H, K, V] unless state_v_first=True ([N, H, V, K], the kernels' own).
    The gate is bounded when use_gate_in_kernel and (safe_gate or lower_bound is set), unbounded
    when use_gate_in_kernel alone, and taken as the log-space decay otherwise. precision:
    "fast" or "precise", as in `fwd`.
    """
    unsupported = sorted(k_ for k_, v_ in kwargs.items() if v_ not in (None, False))
    if unsupported:
        raise ValueError(f"chunk_kda: unsupported options {unsupported}")
    for name, t in (("q", q), ("v", v)):
        _check_tensor(name, t, (torch.bfloat16,), 4)
    for name, t in (("initial_state", initial_state), ("cu_seqlens", cu_seqlens)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(t).__name__}")
    K = q.shape[-1]
    if scale is None:
        scale = K ** -0.5
    if use_gate_in_kernel:
        gate = "bounded" if (safe_gate or lower_bound is not None) else "unbounded"
        if gate == "bounded" and lower_bound is None:
            raise _err("lower_bound", "a float in [-5, 0) with safe_gate", None)
    else:
        gate = "none"
    out = torch.empty(*q.shape[:3], v.shape[-1], dtype=torch.bfloat16, device=q.device)

    def to_vfirst(s):
        return s if s is None or state_v_first else s.transpose(-1, -2).contiguous()

    s0 = to_vfirst(initial_state)
    s1 = None
    if output_final_state:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
        s1 = torch.empty(N, q.shape[2], v.shape[-1], K, dtype=torch.float32, device=q.device)
    fwd(q, k, v, g, beta, float(scale), out, A_log, dt_bias, lower_bound, s0, s1, cu_seqlens,
        workspace, gate=gate, qk_l2norm=use_qk_l2norm_in_kernel,
        beta_sigmoid=use_beta_sigmoid_in_kernel, precision=precision)
    if s1 is not None and not state_v_first:
        s1 = s1.transpose(-1, -2).contiguous()
    return out, s1
