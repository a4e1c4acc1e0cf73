"""The workspace between K1 and K2: K1's outputs, K2's operands, one row per token slot of whole
chunks, each plane 256-byte aligned from a 256-byte aligned base. Pure metadata."""

from __future__ import annotations

import functools
import math

import torch

from ..ladder import FwdConfig
from ..problem import Checkpoints, Problem

_ELEM = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.int32: 4}
ALIGN = 256


def main_slots(p: Problem, chunk: int) -> int:
    """The chunk slots of the sequences' own chunks: B*T // chunk + N (a sequence's last chunk
    padded to `chunk` rows, which K1 writes as zeros); a varlen batch's sequence s starts at
    slot cu_seqlens[s] // chunk + s (`chunk_slots`). Grids shifted to first checkpoint
    boundaries (Checkpoints.shifts): N more, row n from slot cu_seqlens[n] // chunk + 2n
    (`shifted_tables`: its partial first chunk one more)."""
    shifts = p.ckpt is not None and p.ckpt.shifts
    return p.B * p.T // chunk + p.N * (2 if shifts else 1)


def side_slots(p: Problem) -> int:
    """The chunk slots after the main ones for mid-chunk checkpoints' partial chunks (one per
    checkpoint entry: kda_cute.specs.checkpoints): none where every boundary ends a chunk, nor
    for a varlen batch whose grids are shifted (a fixed-length one may run in segments, which
    do not shift)."""
    ck = p.ckpt
    if ck is None or ck.aligned or (ck.shifts and p.varlen):
        return 0
    return p.N * ck.per_row


def rows(p: Problem, chunk: int) -> tuple[int, int]:
    """(chunks, rows) the workspace holds: the main slots, then the side slots."""
    nch = main_slots(p, chunk) + side_slots(p)
    return nch, nch * chunk


def layout(p: Problem, cfg: FwdConfig) -> list[tuple[str, tuple, torch.dtype]]:
    """K1's outputs, in workspace order: fp32 for the SIMT K2; for the tensor-core K2 its 16-bit
    operands: qg and kg fp16, kd, Aw and Mq as bf16 (hi, lo) planes (one fp16 plane each in
    the f16 configs)."""
    C, H, K = cfg.chunk, p.H, p.K
    nch, R = rows(p, C)
    f32, bf16, f16 = torch.float32, torch.bfloat16, torch.float16
    # one int32 per (chunk slot, head): K1 flags the pair once written, for a K2 running
    # alongside it (zeroed before each such launch)
    flags = ("flags", (nch * H,), torch.int32)
    if cfg.prep.operands == "bf16":
        h, planes = (f16, 1) if cfg.prep.f16 else (bf16, 2)
        # qg and kg fp16 in every tensor-core config (abi.QK_DTYPE)
        return [("qg", (R, H, K), f16), ("kg", (R, H, K), f16), ("kd", (planes, R, H, K), h),
                ("gl", (nch, H, K), f32), ("aw", (planes, R, H, C), h),
                ("mq", (planes, R, H, C), h), flags]
    return [("qg", (R, H, K), f32), ("kg", (R, H, K), f32), ("kd", (R, H, K), f32),
            ("gl", (nch, H, K), f32), ("aw", (R, H, C), f32), ("mq", (R, H, C), f32), flags]


def planes(p: Problem, cfg: FwdConfig) -> tuple[tuple, int]:
    """((name, offset, bytes, shape, dtype), ...) from an aligned base, and the bytes a
    workspace needs (one alignment's slack included)."""
    return _planes(_sized(p), cfg)


@functools.lru_cache(maxsize=1024)
def _planes(p: Problem, cfg: FwdConfig) -> tuple[tuple, int]:
    out, start = [], 0
    for name, shape, dtype in layout(p, cfg):
        n = math.prod(shape) * _ELEM[dtype]
        out.append((name, start, n, shape, dtype))
        start += (n + ALIGN - 1) // ALIGN * ALIGN
    return tuple(out), start + ALIGN


def _sized(p: Problem) -> Problem:
    """The fields the workspace depends on (so problems differing elsewhere share a cache
    entry): of the checkpoints, a stand-in with the same slots."""
    ck = p.ckpt
    if ck is not None and (side_slots(p) or ck.shifts):
        ck = Checkpoints(64 if ck.shifts else 0, ck.per_row, 0, 0, torch.float32, 0, 0, 0, 0,
                         first_on=int(ck.shifts))
    else:
        ck = None
    return Problem(p.B, p.T, p.H, p.K, p.V, p.N, p.varlen, ckpt=ck)


def workspace_bytes(p: Problem, cfg: FwdConfig) -> int:
    """Bytes of the caller-ownable workspace: K1's outputs, each 256-byte aligned."""
    return planes(p, cfg)[1]


def views(workspace: torch.Tensor, p: Problem, cfg: FwdConfig) -> dict:
    """K1's outputs as typed views into the workspace (each 256-byte aligned)."""
    base = (-workspace.data_ptr()) % ALIGN
    return {name: workspace[base + off:base + off + n].view(dtype).view(shape)
            for name, off, n, shape, dtype in planes(p, cfg)[0]}


def side_offsets(p: Problem, cfg: FwdConfig) -> dict[str, int]:
    """operand_offsets moved on to the side slots: each plane's first side row (K1's side run
    writes its chunk k at slot k of these)."""
    C = cfg.chunk
    first = main_slots(p, C)
    out = {}
    shapes = {name: (shape, dtype) for name, _, _, shape, dtype in planes(p, cfg)[0]}
    for name, off in operand_offsets(p, cfg).items():
        base = name[:-1] if name[:-1] in ("kd", "aw", "mq") else name
        shape, dtype = shapes[base]
        # a plane's rows: (R, H, X), (planes, R, H, X), or gl's (chunks, H, K); the flags stay
        row = math.prod(shape[-2:]) * _ELEM[dtype]
        out[name] = off if base == "flags" else off + first * (1 if base == "gl" else C) * row
    return out


def operand_offsets(p: Problem, cfg: FwdConfig) -> dict[str, int]:
    """Each workspace argument of K1 and K2, by name, as a byte offset from the aligned base:
    every plane, and for kd, Aw and Mq their hi and lo planes (lo after hi; the f16 configs have
    one plane, which their kernels read and write as hi only: lo names the same plane)."""
    out = {}
    for name, off, n, shape, _ in planes(p, cfg)[0]:
        out[name] = off
        if name in ("kd", "aw", "mq"):
            out[name + "h"] = off
            out[name + "l"] = off + n // shape[0] * (shape[0] - 1)
    return out


def chunk_slots(cu_seqlens: torch.Tensor, chunk: int, ramp: torch.Tensor) -> torch.Tensor:
    """Each varlen sequence's first workspace chunk slot (cu_chunks), cu_seqlens[s] // chunk +
    s (`ramp` = 0, 1, ..., N): no prefix sum over the lengths, and every sequence's slots begin
    past the previous one's last chunk (floor((a + n) / C) - floor(a / C) + 1 >= ceil(n / C)
    slots for n tokens). The slots between (at most one a sequence) hold no tokens: K1 skips
    them, K2 never reads them. A fixed-length batch packs its chunks instead (the segment
    offsets). The offsets kernel (kernels/kda_offsets_sm90.py) computes the same on the device;
    this is its host-side reference (tests, kda_cute.testing)."""
    return torch.div(cu_seqlens, chunk, rounding_mode="floor").add_(ramp)


def shifted_tables(cu_seqlens: torch.Tensor, first: torch.Tensor, chunk: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The offsets kernel's shifted tables (its host-side reference, for tests): row n's chunk
    grid starts sigma = (chunk - f) % chunk tokens before it, f = first[n] % chunk (0 for an
    empty row). K1's cu_seqlens and cu_chunks (2N + 1 entries): row n split at min(bos + f,
    eos), its partial first chunk at slot bos // chunk + 2n and the rest from the slot after;
    K2's cu_chunks (N + 1): chunk0 * chunk + sigma, chunk0 the slot of the row's first chunk
    (the last entry: the slot bound * chunk). Integer tensors on the CPU."""
    cu = cu_seqlens.to(torch.int64).cpu()
    N = cu.numel() - 1
    f = first.to(torch.int64).cpu().reshape(-1)[:N] % chunk
    bos, eos = cu[:-1], cu[1:]
    f = torch.where(eos == bos, torch.zeros_like(f), f)
    base = torch.div(cu, chunk, rounding_mode="floor") + 2 * torch.arange(N + 1)
    cu1 = torch.empty(2 * N + 1, dtype=torch.int64)
    cc1 = torch.empty(2 * N + 1, dtype=torch.int64)
    cu1[0::2], cc1[0::2] = cu, base
    cu1[1::2], cc1[1::2] = torch.minimum(bos + f, eos), base[:-1] + 1
    chunk0 = base[:-1] + (f == 0).to(torch.int64)
    cc2 = torch.cat([chunk0 * chunk + (-f) % chunk, base[-1:] * chunk])
    return cu1.to(torch.int32), cc1.to(torch.int32), cc2.to(torch.int32)
