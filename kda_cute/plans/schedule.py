"""How a forward runs its two kernels on a device: the rules, each with what it was measured
against on the H200 (docs/design.md, "Schedules"). Pure functions of the problem, the options,
the forward's config and the device.

- serial: K1, then K2 (in its WY form where every K2 CTA has an SM to itself);
- alongside: K2 first, alone on its SMs, K1 beside it as its programmatic dependent, where K2's
  grid leaves at least half of the SMs idle;
- segments: K2 over P segments of each sequence, then the combine, where the plain grid fills at
  most a quarter of the SMs.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from .. import segments as seg
from ..ladder import ALONGSIDE_K1_PER_PAIR, FwdConfig, alongside_of, combine_config, wy_of
from ..problem import Options, Problem
from ..specs.recur import RecurConfig
from .device import SMEM_RESERVED, SMEM_UNIT, DeviceInfo, resident, resident_per_sm, resources

# K2 runs alongside K1 only where the sequences average at least this many chunks (shorter
# ones, decode above all, would pay the flags' memset and gain nothing)
ALONGSIDE_MIN_CHUNKS = 32


@dataclass(frozen=True)
class Schedule:
    kind: str  # "serial" | "alongside" | "segments"
    segments: int  # K2's segments per sequence (1 unless kind == "segments")
    k2_grid: tuple[int, int, int] | None  # None: K2 has no work (no sequence or no head)

    def __str__(self) -> str:
        return f"segments {self.segments}" if self.kind == "segments" else self.kind


def decide(p: Problem, opts: Options, cfg: FwdConfig, dev: DeviceInfo) -> Schedule:
    if p.N == 0 or p.H == 0:
        return Schedule("serial", 1, None)
    P = segment_count(p, opts, cfg, dev)
    nz = p.N
    if not p.varlen and cfg.recur.mma == "wgmma":
        nz = -(-p.N // k2_seqs_per_cta(p.N, p.V // cfg.recur.block_v * p.H,
                                       resident(dev, resources(cfg.recur, dev.arch))))
    grid = (p.V // cfg.recur.block_v, p.H, nz)
    if P > 1 or (opts.context and segmentable(p, cfg)):
        return Schedule("segments", P, grid)
    if (p.B * p.T >= ALONGSIDE_MIN_CHUNKS * cfg.chunk * p.N
            and alongside(opts, cfg, grid, dev)):
        return Schedule("alongside", 1, grid)
    return Schedule("serial", 1, grid)


def segmentable(p: Problem, cfg: FwdConfig) -> bool:
    """Whether K2 can run over segments: K == V (the identity run reuses K2's config), a
    combine kernel for K, tokens, and for a varlen batch dense states, and checkpoints only in
    a context shard's (its segments are built on the device from cu_seqlens; a forward's
    every-n checkpoints from first boundaries shift its rows' grids, and its workspace counts
    no side slots for them)."""
    return not (p.K != p.V or cfg.recur.mma != "wgmma" or p.B * p.T == 0 or p.N == 0
                or combine_config(p.K) is None
                or (p.varlen and (p.pool is not None
                                  or (p.ckpt is not None and not p.ckpt.fixed_grid))))


def segment_count(p: Problem, opts: Options, cfg: FwdConfig, dev: DeviceInfo) -> int:
    """Segments per sequence for K2 (1: the plain recurrence) where `segmentable` (a varlen
    batch's chosen for the mean length: its lengths are unknown to the host; a
    context-parallel shard's by its own model). Options.segments (an int) overrides the
    choice."""
    if not segmentable(p, cfg):
        return 1
    if opts.segments is not None:
        return max(1, min(int(opts.segments), -(-p.T // cfg.chunk)))
    if opts.context:
        return seg.choose_context(p.N, -(-p.B * p.T // p.N), p.H, p.V, cfg.chunk,
                                  cfg.recur.block_v, dev.sms)
    return seg.choose(p.N, -(-p.B * p.T // p.N), p.H, p.V, cfg.chunk, cfg.recur.block_v,
                      dev.sms)


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


def alongside(opts: Options, cfg: FwdConfig, k2_grid: tuple, dev: DeviceInfo) -> bool:
    """Whether K2 runs alongside K1 rather than after it: where K2's grid (one CTA per SM)
    takes at most half of the SMs, so K1 keeps the other half and K2 consumes each chunk as
    K1 flags it (the tensor-core forwards with an alongside build, ladder.ALONGSIDE). K2 is
    then launched first and every one of its CTAs is resident before K1 starts (K1 is its
    programmatic dependent), so its waits always end. Measured on the H200 (K1 held to
    k1_alongside_ctas): B1 T8192 H32 -20% at K = 128 and 64; K2's steps are still ~15% slower
    than alone (K1's memory traffic), so it pays only where K2 leaves SMs idle."""
    if alongside_of(cfg) is None or not opts.alongside:
        return False
    return math.prod(k2_grid) <= dev.sms // 2


def k2_serial(opts: Options, cfg: FwdConfig, k2_grid: tuple, dev: DeviceInfo) -> RecurConfig:
    """The K2 of a serial forward: its WY-form build (ladder.WY_RUNS) where every CTA has an
    SM to itself (the grid within one CTA per SM, or a kernel that holds one per SM), the
    plain one otherwise. Measured on the H200: K2 -6% at K = 128 B1 T8192 H64 and -5% at
    K = 256; slower where two CTAs share an SM. Options.wy "off" never takes it, "force"
    wherever one is built (for measuring)."""
    w = wy_of(cfg.recur)
    if w is None or opts.wy == "off":
        return cfg.recur
    if (opts.wy == "force" or math.prod(k2_grid) <= dev.sms
            or resident_per_sm(dev, resources(cfg.recur, dev.arch)) == 1):
        return w
    return cfg.recur


def longest_first(p: Problem, cfg: FwdConfig, k2_grid, dev: DeviceInfo) -> bool:
    """Whether K2's grid z takes the sequences longest first (the kernel ranks them from
    cu_seqlens): a varlen batch of 2 .. threads - 1 sequences whose K2 grid needs more than one
    wave. Its CTAs are dispatched about in grid order, so a long sequence that comes last in
    cu_seqlens would otherwise start last and run on alone at the end."""
    res = resources(cfg.recur, dev.arch)
    return (p.varlen and 2 <= p.N < res.threads and k2_grid is not None
            and math.prod(k2_grid) > resident(dev, res))


def k1_alongside_ctas(p: Problem, k2_ctas: int, dev: DeviceInfo, k1) -> int:
    """K1 CTAs per SM alongside K2: ALONGSIDE_K1_PER_PAIR per (sequence, head) pair per SM left
    to K1, at least one, at most what fits (`k1`: K1's Resources)."""
    free = max(1, dev.sms - k2_ctas)
    want = round(ALONGSIDE_K1_PER_PAIR[p.K] * p.N * p.H / free)
    return max(1, min(want, resident_per_sm(dev, k1)))


def k1_alongside_smem(dev: DeviceInfo, ctas: int) -> int:
    """The shared memory reservation that holds K1 to `ctas` CTAs per SM (the launch takes
    the kernel's own where that is more)."""
    return dev.smem_per_sm // ctas // SMEM_UNIT * SMEM_UNIT - SMEM_RESERVED
