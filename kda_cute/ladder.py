"""The head-dim / layout ladder: which forwards and kernels ship, and which one a problem runs.

A forward (`FwdConfig`) is one K1 and one K2 that agree on the chunk; the kernels' own configs
and constraints are their specs' (kda_cute.specs). Everything here is pure data: no DSL import,
no driver call. `all_kernels()` is the one list of every kernel built and shipped, read by the
AOT build, the ABI tests, `cuda_ready` and the demo.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from .problem import Options, StepOptions, StepProblem
from .specs import prep, recur
from .specs.checkpoints import CheckpointsConfig
from .specs.combine import CombineConfig
from .specs.offsets import OffsetsConfig
from .specs.prep import PrepConfig
from .specs.recur import RecurConfig
from .specs.step import WRITE_START, StepConfig
from .specs.step import supports as step_supports

HEAD_DIMS = (64, 128, 256)


@dataclass(frozen=True)
class FwdConfig:
    """A forward: one K1 and one K2 that agree on the chunk size."""

    prep: PrepConfig
    recur: RecurConfig

    @property
    def chunk(self) -> int:
        return self.prep.chunk


def supports(cfg: FwdConfig) -> tuple[bool, str]:
    if cfg.prep.chunk != cfg.recur.chunk:
        return False, f"K1 chunk {cfg.prep.chunk} != K2 chunk {cfg.recur.chunk}"
    if cfg.prep.alongside != cfg.recur.alongside:
        return False, (f"K1 alongside {cfg.prep.alongside} != K2 alongside "
                       f"{cfg.recur.alongside}")
    if cfg.prep.f16 != cfg.recur.f16:
        return False, f"K1 f16 {cfg.prep.f16} != K2 f16 {cfg.recur.f16}"
    if cfg.prep.head_dim_k != cfg.recur.head_dim_k:
        return False, (f"K1 head_dim_k {cfg.prep.head_dim_k} != K2 head_dim_k "
                       f"{cfg.recur.head_dim_k}")
    want = "bf16" if cfg.recur.mma == "wgmma" else "f32"
    if cfg.prep.operands != want:
        return False, (f"K2 mma {cfg.recur.mma!r} reads K1 operands {want!r}, got "
                       f"{cfg.prep.operands!r}")
    for ok, why in (prep.supports(cfg.prep), recur.supports(cfg.recur)):
        if not ok:
            return ok, why
    return True, ""


def _prep_threads(k: int) -> int:
    """K1 threads: one per key column (K1's phase A maps threads to columns)."""
    return max(128, k)


def _fwd(k: int, v: int, chunk: int = 16, block_v: int = 16) -> FwdConfig:
    """The first (fp32 SIMT) forward."""
    return FwdConfig(PrepConfig(k, chunk, _prep_threads(k)), RecurConfig(k, v, chunk, block_v))


def _tc_fwd(k: int, v: int, chunk: int = 16, stages: int = 4, f16: bool = False) -> FwdConfig:
    """The tensor-core forward: K1 writes bf16 operands, K2 runs every product on wgmma. At
    K = 64, chunk 16, K1 runs one thread per column (two warps): eleven CTAs per SM instead of
    five, K1 0.293 -> 0.227 ms at B1 T8192 H64 (docs/notes/k1.md)."""
    threads = 64 if (k, chunk) == (64, 16) else _prep_threads(k)
    return FwdConfig(PrepConfig(k, chunk, threads, operands="bf16", f16=f16),
                     RecurConfig(k, v, chunk, 64, stages=stages, mma="wgmma", f16=f16))


# The tensor-core forwards: what the ladder picks. "fast" (the default): every K2 product one
# fp16 warpgroup MMA, K1's operands fp16; "precise": P = S kg^T and Pq = S qg^T on fp16 (qg, kg
# fp16; S's fp16 copy scaled row by row by a power of two each chunk), the other products on
# bf16 hi/lo splits (three MMAs each): the fp32 state at ~5e-6 instead of ~3.5e-4 against
# float64, never less accurate than fast (docs/notes/precision.md), and bf16's range for the
# values (fp16's overflows past ~6.5e4: README, limits).
FAST: tuple[FwdConfig, ...] = tuple(_tc_fwd(d, d, f16=True) for d in HEAD_DIMS)
PRECISE: tuple[FwdConfig, ...] = tuple(_tc_fwd(d, d) for d in HEAD_DIMS)
TENSOR_CORE: tuple[FwdConfig, ...] = FAST + PRECISE
PRECISIONS = ("fast", "precise")
# The fp32 CUDA-core forwards: the accuracy baseline (fp32 products throughout), reachable with
# fwd(config=...), used by the tests and the benchmark's --simt comparison.
SIMT: tuple[FwdConfig, ...] = tuple(_fwd(d, d) for d in HEAD_DIMS)

# Every config the build ships. The ladder (select_config) only picks from these.
SHIPPED: tuple[FwdConfig, ...] = TENSOR_CORE + SIMT

# Built and ABI-checked like the shipped ones, reachable through fwd(config=...), not picked by
# the ladder: chunk 32 (half the serial steps; slower overall, docs/notes/k2.md).
EXPERIMENTAL: tuple[FwdConfig, ...] = (
    tuple(_tc_fwd(d, d, chunk=32, stages=2) for d in HEAD_DIMS))


# The segmented K2's state runs (from zero, and the identity rows): each tensor-core K2 without
# its outputs (the segments schedule, kda_cute.plans.prefill; segments need K == V).
SEGMENT_RUNS: tuple[RecurConfig, ...] = tuple(
    RecurConfig(**{**f.recur.as_dict(), "outputs": False}) for f in TENSOR_CORE
    if f.recur.head_dim_k == f.recur.head_dim_v)

# K2 in the WY form (RecurConfig.wy), for the fp16 forwards at K >= 128: faster only where each
# K2 CTA has an SM to itself (plans.schedule.k2_serial picks it), slower with two K2 CTAs on an
# SM and alongside K1 (docs/notes/k2.md, "The fp16 forward in the WY form").
# Having its SM to itself, K = 128's streams its chunks through eight stages instead of four, so
# its loads stay ahead of the chunks where checkpoint stores compete with them (docs/notes/k2.md,
# "Eight stages for the WY form"); K = 256's stages are too large for more than four.
WY_STAGES = {128: 8}
_WY_OF: dict[RecurConfig, RecurConfig] = {
    f.recur: RecurConfig(**{**f.recur.as_dict(), "wy": True,
                            "stages": WY_STAGES.get(f.recur.head_dim_k, f.recur.stages)})
    for f in TENSOR_CORE if f.recur.f16 and f.recur.head_dim_k >= 128}
WY_RUNS: tuple[RecurConfig, ...] = tuple(_WY_OF.values())


def wy_of(recur: RecurConfig) -> RecurConfig | None:
    """The WY-form build of a shipped K2 (WY_RUNS), or None."""
    return _WY_OF.get(recur)


# K2 alongside K1 (plans.schedule.alongside): each tensor-core forward built to run its two
# kernels at once, K1 flagging each (chunk, head) and K2 waiting on the flags (serial forwards
# carry none of that code). K2's shared memory is padded to a whole SM's there, so at K = 64 and
# 128 it streams its chunks through eight stages instead of four (K = 256's stages too large).
ALONGSIDE: tuple[FwdConfig, ...] = tuple(
    FwdConfig(PrepConfig(**{**f.prep.as_dict(), "alongside": True}),
              RecurConfig(**{**f.recur.as_dict(), "alongside": True,
                             "stages": 8 if f.recur.head_dim_k <= 128 else f.recur.stages}))
    for f in TENSOR_CORE)
# K1 alongside K2 is held to fewer CTAs per SM than it fits (the launcher pads its shared
# memory): at its full occupancy its memory traffic slows K2's steps, which set the pace. It
# needs about this many CTAs per SM for each (sequence, head) pair per SM left to it (K2
# consumes one chunk of every pair a step): each the best of a sweep over CTAs per SM, K = 128's
# re-fitted for its fp16 forward, whose faster K2 steps need K1 further ahead
# (docs/notes/schedules.md).
ALONGSIDE_K1_PER_PAIR = {64: 12.0, 128: 13.0, 256: 8.0}


@functools.lru_cache(maxsize=64)
def alongside_of(cfg: FwdConfig) -> FwdConfig | None:
    """The alongside build of a shipped tensor-core forward, or None (cached: the launch path
    asks on every call)."""
    for a in ALONGSIDE:
        if (dataclasses.replace(a.prep, alongside=False) == cfg.prep
                and dataclasses.replace(a.recur, alongside=False, stages=cfg.recur.stages)
                == cfg.recur):
            return a
    return None


# K2 storing checkpoints (RecurConfig.checkpoints): the main K2 of a forward asked for them, a
# twin of each tensor-core K2 a forward's schedule runs (serial, WY, alongside; the segments'
# last run); the others carry no checkpoint code, so a forward without them runs as before.
CHECKPOINT_RUNS: tuple[RecurConfig, ...] = tuple(
    dataclasses.replace(r, checkpoints=True)
    for r in dict.fromkeys([f.recur for f in TENSOR_CORE] + list(WY_RUNS)
                           + [f.recur for f in ALONGSIDE]))


@functools.lru_cache(maxsize=64)
def checkpoints_of(recur: RecurConfig) -> RecurConfig | None:
    """The checkpoints build of a shipped K2 (CHECKPOINT_RUNS), or None."""
    c = dataclasses.replace(recur, checkpoints=True)
    return c if c in CHECKPOINT_RUNS else None


# K1 looped over the side slots in use (PrepConfig.looped): the checkpoints' side run, one twin
# of each tensor-core forward's K1 (its partial chunks over one resident wave of CTAs: a grid of
# one CTA a side slot and head, nearly all finding nothing where the boundaries end chunks, cost
# more; docs/notes/k2.md, "K1's side run looped over one resident wave")
SIDE_PREPS: tuple[PrepConfig, ...] = tuple(
    dataclasses.replace(p, looped=True) for p in dict.fromkeys(f.prep for f in TENSOR_CORE))


def looped_of(prep: PrepConfig) -> PrepConfig | None:
    """The looped twin of a shipped tensor-core K1 (SIDE_PREPS), or None."""
    c = dataclasses.replace(prep, looped=True)
    return c if c in SIDE_PREPS else None


# The segments' combine, one per head dim (the segmented K2 runs with K == V).
# The rescale runs (RecurConfig.rescale): one per head dim, after every K2 of a fast forward
# (the checkpoints build's code, so it redoes a checkpointed forward's stores too)
RESCALE_RUNS: tuple[RecurConfig, ...] = tuple(
    dataclasses.replace(f.recur, checkpoints=True, rescale=True) for f in FAST)


@functools.lru_cache(maxsize=64)
def rescale_of(recur: RecurConfig) -> RecurConfig | None:
    """The rescale run after a K2 of the fast forward of its head dim (any of its builds:
    serial, WY, alongside, checkpoints, output-free), or None (precise and SIMT K2s: their
    overflow is reported, not redone)."""
    if not recur.f16 or recur.mma != "wgmma":
        return None
    for r in RESCALE_RUNS:
        if (r.head_dim_k, r.head_dim_v, r.chunk) == (recur.head_dim_k, recur.head_dim_v,
                                                     recur.chunk):
            return r
    return None


COMBINE: tuple[CombineConfig, ...] = tuple(CombineConfig(d) for d in HEAD_DIMS)
# a varlen forward's offsets (cu_seqlens checked and copied, the chunk slots), on the device
OFFSETS = OffsetsConfig()
# a prefill's checkpoints: K2's tables and the side slots (kda_cute.specs.checkpoints)
CHECKPOINTS = CheckpointsConfig()


def combine_config(head_dim: int) -> CombineConfig | None:
    for cfg in COMBINE:
        if cfg.head_dim_k == head_dim:
            return cfg
    return None


# The token step (decode, verify, commit): per head dim and pool dtype, as many lanes per state
# row as 16-byte pool accesses make a row (at most a warp) and 32 rows per CTA, so many CTAs (and
# their bytes) are in flight on each SM. Other tiles
# are reachable through StepOptions.config.
def _step(d: int, pool: str, block_v: int = 32, unroll: int = 0) -> StepConfig:
    vec = 4 if pool == "float32" else 8
    return StepConfig(d, d, pool, min(d, block_v), min(32, d // vec), 128, unroll=unroll)


# bf16 pools at K <= 128: 64 rows per CTA, the row loop unrolled by two (the K = 128 tile
# sweep's fastest from N 64); at K = 128 its loads a step ahead (faster verify).
# fp32 pools at K = 128: the 32-row tile unrolled by two (faster verify than the plain tile).
# The sweeps: docs/serving.md.
def _step_tile(d: int, pool: str) -> StepConfig:
    """STEP's tile for head dim d and the pool's dtype."""
    if d == 128:
        return (StepConfig(128, 128, pool, 64, 16, 128, unroll=2, ahead=True)
                if pool == "bfloat16" else _step(d, pool, 32, 2))
    return _step(d, pool, 64, 2) if pool == "bfloat16" and d < 128 else _step(d, pool)


STEP: tuple[StepConfig, ...] = tuple(_step_tile(d, p) for d in HEAD_DIMS
                                     for p in ("float32", "bfloat16"))
# Single-token plans (decode; a verify keeps fp32 state between tokens and takes STEP): rows x
# heads from which a tile is taken, and the tile, each the sweep's fastest in its range
# (docs/serving.md):
# - small grids are latency-bound: fewer rows per CTA, more CTAs. Below 48 rows x heads, 16 rows
#   with the loads ahead; below 192, 32 rows unrolled by two, loads ahead.
# - fp32 from 192: 64 rows unrolled by two.
# - bf16 from 192: a persistent grid of 64-row tiles, 5 CTAs an SM (StepConfig.persist: each CTA
#   stages its next tile and issues its loads while it computes the current one), the row loop
#   unrolled by two; at 6 CTAs an SM its registers would leave one CTA in six waiting.
# - bf16 from 6144, a whole head per CTA (128 rows unrolled by two, loads ahead). Only for
#   single-token plans: a verify's fp32 keep area would hold it to three CTAs per SM.
STEP_SINGLE: tuple[tuple[int, StepConfig], ...] = (
    (1, StepConfig(128, 128, "float32", 16, 32, 128, ahead=True)),
    (48, StepConfig(128, 128, "float32", 32, 32, 128, unroll=2, ahead=True)),
    (192, _step(128, "float32", 64, 2)),
    (1, StepConfig(128, 128, "bfloat16", 16, 16, 128, ahead=True)),
    (48, StepConfig(128, 128, "bfloat16", 32, 16, 128, unroll=2, ahead=True)),
    (192, StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, persist=5)),
    (6144, StepConfig(128, 128, "bfloat16", 128, 16, 128, unroll=2, ahead=True)),
)

# Multi-token plans (verify) whose rows hold at least `least` tokens, by pool: a bf16 pool's
# tile with the CTA's row groups preparing each chunk of four tokens together (StepConfig.prep)
# instead of every group doing each token's math itself: faster than STEP's tile from four
# tokens a row, slower at two; an fp32 pool's prepared tiles gain nothing (not taken;
# docs/serving.md).
STEP_MULTI: tuple[tuple[int, StepConfig], ...] = (
    (4, StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, prep=4)),
)

# Multi-token plans on a bf16 pool whose rows hold at most `most` tokens, without tree parents
# or commits (those take STEP_MULTI's or STEP's): the row's tokens as one chunk
# (StepConfig.chunk): every token's products with the start state by warp MMA, a T x T solve a
# row, then the states after each token by the plain update; the tile of the fewest tokens that
# holds the rows.
STEP_CHUNK: tuple[tuple[int, StepConfig], ...] = (
    *((c, StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, chunk=c)) for c in (2, 4)),
    # 5-8 tokens: 128 rows and 256 threads a CTA, faster than the 64-row tile
    # (docs/notes/step.md, "The chunked tile in the CuTe kernel")
    (8, StepConfig(128, 128, "bfloat16", 128, 16, 256, unroll=2, chunk=8)))

# other tiles, built for the tile sweep (bench/serving.py --sweep): fewer and more rows per CTA
STEP_VARIANTS: tuple[StepConfig, ...] = tuple(c for c in dict.fromkeys(
    [_step(128, p, bv) for p in ("float32", "bfloat16") for bv in (8, 16, 32, 64)]
    + [_step(128, p, bv, 2) for p in ("float32", "bfloat16") for bv in (32, 64)]
    + [StepConfig(128, 128, "bfloat16", bv, 32, 128, access=8, unroll=u)
       for bv in (32, 64) for u in (0, 2)]
    # more state per CTA for bf16 pools: 128 rows, or 256 threads
    + [StepConfig(128, 128, "bfloat16", 128, 16, 128, unroll=u) for u in (2, 4)]
    + [StepConfig(128, 128, "bfloat16", 128, 32, 128, access=8, unroll=2)]
    + [StepConfig(128, 128, "bfloat16", bv, 16, 256, unroll=2) for bv in (64, 128)]
    # registers capped (min_blocks) beside the shipped capped tiles
    + [StepConfig(128, 128, "bfloat16", 128, 16, 128, unroll=2, min_blocks=6)]
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=u, min_blocks=8) for u in (2, 4)]
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, min_blocks=10)]
    + [StepConfig(128, 128, "float32", 32, 32, 128, min_blocks=12)]
    # persistent tiles (single-token plans): a CTA stages its next tile while it computes
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, persist=4)]
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=4, min_blocks=6, persist=6)]
    + [StepConfig(128, 128, "bfloat16", 128, 16, 128, unroll=4, persist=3)]
    + [StepConfig(128, 128, "bfloat16", 32, 16, 128, min_blocks=8, persist=8)]
    + [StepConfig(128, 128, "float32", 32, 32, 128, persist=6)]
    + [StepConfig(128, 128, "float32", 16, 32, 128, min_blocks=12, persist=12)]
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, min_blocks=6, persist=6)]
    + [StepConfig(128, 128, "float32", 32, 32, 128, unroll=2, min_blocks=7)]
    # a token's loads issued a step ahead: the first token's with the staging, the next
    # token's during this one's rows
    + [StepConfig(128, 128, "bfloat16", bv, 16, 128, unroll=u, ahead=True)
       for bv, u in ((64, 2), (32, 2), (32, 0), (16, 0), (8, 0), (128, 2))]
    + [StepConfig(128, 128, "float32", bv, 32, 128, ahead=True) for bv in (32, 16, 8)]
    + [StepConfig(128, 128, "float32", bv, 32, 128, unroll=2, ahead=True) for bv in (32, 64)]
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, persist=6)]
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=4, min_blocks=m, ahead=True)
       for m in (0, 4)]
    # a chunk of tokens prepared by the CTA's row groups together (StepConfig.prep)
    + [StepConfig(128, 128, "bfloat16", bv, 16, 128, unroll=u, prep=4)
       for bv, u in ((128, 2), (32, 2), (16, 0))]
    + [StepConfig(128, 128, "float32", bv, 32, 128, unroll=u, prep=4)
       for bv, u in ((32, 2), (64, 2), (16, 0))]
    # 8 lanes a row (16 columns a thread): one shuffle level fewer a reduction
    + [StepConfig(128, 128, "bfloat16", bv, 8, 128, unroll=u, ahead=a)
       for bv, u, a in ((64, 2, False), (64, 2, True), (128, 2, False), (128, 4, False),
                        (32, 0, False))]
    # the chunked tiles (StepConfig.chunk) with the row loop whole; at 128 rows (8 warps); at
    # 16 and 32 rows (one and two warps: more CTAs an SM, for decode and small batches)
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, chunk=2)]
    # (the 64-row chunk of 8, STEP_CHUNK's before the 128-row one: kept for the sweep)
    + [StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, chunk=8)]
    + [StepConfig(128, 128, "bfloat16", 128, 16, 256, unroll=2, chunk=c) for c in (2, 4, 8)]
    + [StepConfig(128, 128, "bfloat16", bv, 16, 2 * bv, chunk=c)
       for bv, c in ((16, 2), (32, 2), (32, 4))]
    # ... persistent (a CTA stages its next tile while it computes this one)
    + [StepConfig(128, 128, "bfloat16", bv, 16, 2 * bv, unroll=u, chunk=2, persist=p)
       for bv, u, p in ((64, 2, 5), (32, 0, 8), (16, 0, 12))]
    # ... and at K = 64 (8 lanes a row: chunks of 4 and 8, the preparing groups whole warps)
    # and K = 256
    + [StepConfig(64, 64, "bfloat16", 64, 8, 128, unroll=2, chunk=c) for c in (4, 8)]
    + [StepConfig(256, 256, "bfloat16", 64, 16, 128, unroll=2, chunk=c) for c in (2, 4, 8)]
    # ... and on fp32 pools (the start state split into tf32 hi and lo for m16n8k8): 64 rows,
    # 32 rows (two warps), persistent
    + [StepConfig(128, 128, "float32", 64, 16, 128, unroll=2, chunk=c) for c in (2, 4, 8)]
    + [StepConfig(128, 128, "float32", 32, 16, 64, chunk=c) for c in (2, 4)]
    + [StepConfig(128, 128, "float32", bv, 16, 2 * bv, unroll=u, chunk=2, persist=p)
       for bv, u, p in ((64, 2, 2), (32, 0, 4))])
    if c not in STEP + tuple(c for _, c in STEP_SINGLE + STEP_MULTI + STEP_CHUNK))


def step_tiles() -> tuple[StepConfig, ...]:
    """Every built token-step tile once: STEP's, STEP_SINGLE's, then the sweep's variants."""
    return tuple(dict.fromkeys(STEP + tuple(c for _, c in STEP_SINGLE + STEP_MULTI + STEP_CHUNK)
                               + STEP_VARIANTS))


def select_chunk(head_dim_k: int, head_dim_v: int, pool: str, tokens: int) -> StepConfig | None:
    """STEP_CHUNK's tile of the fewest tokens that holds rows of up to `tokens` (at least two)
    for (K, V) and the pool's dtype name, or None (the caller has ruled out tree parents and
    commits)."""
    fits = [(most, c) for most, c in STEP_CHUNK if 2 <= tokens <= most
            and (c.head_dim_k, c.head_dim_v, c.pool) == (head_dim_k, head_dim_v, pool)]
    return min(fits, key=lambda x: x[0])[1] if fits else None


def select_step(head_dim_k: int, head_dim_v: int, pool: str, heads: int = 0,
                persistent: bool = True, tokens: int = 0) -> StepConfig | None:
    """The shipped token-step config for (K, V) and the pool's dtype name, or None. `heads`
    > 0 says the plan is single-token, with that many rows x heads: STEP_SINGLE's tile with
    the largest threshold reached (not a persistent one unless `persistent`: a commit has no
    token), where there is one; else, for a multi-token plan of up to `tokens` tokens a row,
    STEP_MULTI's tile with the largest threshold reached; else STEP's."""
    key = (head_dim_k, head_dim_v, pool)
    if heads <= 0:
        multi = [(least, c) for least, c in STEP_MULTI
                 if tokens >= least and (c.head_dim_k, c.head_dim_v, c.pool) == key]
        if multi:
            return max(multi, key=lambda x: x[0])[1]
    best = None
    for least, cfg in STEP_SINGLE:
        if cfg.persist and not persistent:
            continue
        if heads > 0 and heads >= least and (cfg.head_dim_k, cfg.head_dim_v, cfg.pool) == key:
            if best is None or least >= best[0]:
                best = (least, cfg)
    if best is not None:
        return best[1]
    for cfg in STEP:
        if (cfg.head_dim_k, cfg.head_dim_v, cfg.pool) == key:
            return cfg
    return None


def select_config(head_dim_k: int, head_dim_v: int, varlen: bool,
                  precision: str = "fast") -> FwdConfig | None:
    """The head-dim / layout ladder: the shipped tensor-core config for (K, V) of `precision`
    ("fast": fp16 products; "precise": bf16 hi/lo products). One config per head dim and
    precision so far (chunk 16, 64 state rows per CTA); `varlen` is accepted for
    layout-specific entries and not used yet."""
    for cfg in FAST if precision == "fast" else PRECISE:
        if cfg.prep.head_dim_k == head_dim_k and cfg.recur.head_dim_v == head_dim_v:
            return cfg
    return None


def config_for(p, opts=None):
    """The config that runs problem `p` under `opts`: the one function that chooses.

    A forward (Problem, Options): Options.config as given (its head dims checked), or the
    shipped config of Options.precision for the head dims (select_config). A serving step
    (StepProblem, StepOptions): StepOptions.config as given (checked against the step's
    tokens, head dims and pool), or the ladder's tile: a single-token tile (STEP_SINGLE's, by
    rows x heads) where a row has one token, since between tokens a bf16 pool keeps an fp32
    copy of the tile in shared memory and their register caps were fitted on decode; a
    chunked tile (STEP_CHUNK's) for chains of few enough tokens; else STEP_MULTI's or STEP's.
    ValueError naming the argument where none fits."""
    if isinstance(p, StepProblem):
        return _step_config(p, opts if opts is not None else StepOptions())
    opts = opts if opts is not None else Options()
    config = opts.config
    if config is not None:
        if (config.prep.head_dim_k, config.recur.head_dim_v) != (p.K, p.V):
            raise ValueError(f"config: expected head dims ({p.K}, {p.V}), got "
                             f"({config.prep.head_dim_k}, {config.recur.head_dim_v})")
        return config
    cfg = select_config(p.K, p.V, p.varlen, opts.precision)
    if cfg is None:
        raise ValueError("q/v: expected head dims (K, V) with a shipped config: (64, 64), "
                         f"(128, 128), (256, 256), got K={p.K}, V={p.V}")
    return cfg


def single_token(p) -> bool:
    """A step of at most one token a row and no tree parents."""
    return p.max_tokens <= 1 and not p.parent.parent_on


def _persistent_ok(p) -> bool:
    """A persistent tile runs rows of one token (no commits, no tree parents)."""
    return single_token(p) and p.max_tokens == 1 and p.write.write_mode != WRITE_START


def _chunk_ok(p, chunk: int) -> bool:
    """A chunked tile runs rows of at most `chunk` tokens, without tree parents or commits."""
    return p.max_tokens <= chunk and not p.parent.parent_on and p.write.write_mode != WRITE_START


def _step_config(p, opts) -> StepConfig:
    cfg = opts.config
    if cfg is not None:
        what = (f"got {p.form} with up to {p.max_tokens} tokens a row"
                + (", tree parents" if p.parent.parent_on else "")
                + (", a commit" if p.write.write_mode == WRITE_START else ""))
        if cfg.chunk and not _chunk_ok(p, cfg.chunk):
            raise ValueError(f"config: a chunked tile ({cfg.name}) runs rows of at most "
                             f"{cfg.chunk} tokens without tree parents or commits; {what}")
        if cfg.persist and not cfg.chunk and not _persistent_ok(p):
            raise ValueError(f"config: a persistent tile ({cfg.name}) runs single-token steps "
                             f"only (decode, or a verify of one token a row); {what}")
    else:
        if p.max_tokens >= 2 and _chunk_ok(p, p.max_tokens):
            cfg = select_chunk(p.K, p.V, p.pool, p.max_tokens)
        if cfg is None:
            cfg = select_step(p.K, p.V, p.pool, p.N * p.H if single_token(p) else 0,
                              _persistent_ok(p), p.max_tokens)
        if cfg is None:
            raise ValueError("q/state: expected head dims K == V in (64, 128, 256) with an "
                             f"fp32 or bf16 pool, got K={p.K}, V={p.V}, pool {p.pool}")
    ok, why = step_supports(cfg)
    if not ok or (cfg.head_dim_k, cfg.head_dim_v, cfg.pool) != (p.K, p.V, p.pool):
        raise ValueError(f"config: expected a StepConfig for K={p.K}, V={p.V}, pool {p.pool}, "
                         f"got {why or cfg.name}")
    return cfg


def all_kernels() -> tuple:
    """Every kernel config that is built and shipped, once each: the forwards' K1 and K2
    (shipped, experimental and alongside builds), then K2's segment runs, WY and checkpoints
    builds, the looped K1s, the rescale runs, the combines, the token steps, the offsets and
    the checkpoints kernel."""
    seen, out = set(), []
    for cfg in [c for f in SHIPPED + EXPERIMENTAL + ALONGSIDE for c in (f.prep, f.recur)] + [
            *SEGMENT_RUNS, *WY_RUNS, *CHECKPOINT_RUNS, *SIDE_PREPS, *RESCALE_RUNS, *COMBINE,
            *STEP,
            *(c for _, c in STEP_SINGLE + STEP_MULTI + STEP_CHUNK), *STEP_VARIANTS, OFFSETS,
            CHECKPOINTS]:
        if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
    return tuple(out)
