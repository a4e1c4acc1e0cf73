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
from .specs import HEAD_DIMS, prep, recur
from .specs.checkpoints import CheckpointsConfig
from .specs.combine import CombineConfig
from .specs.offsets import OffsetsConfig
from .specs.prep import PrepConfig
from .specs.recur import RecurConfig

# the token step's tiles: config_for below chooses among them
from .step_ladder import REPLAY, REPLAY_VARIANTS, step_config, step_tiles


@dataclass(frozen=True)
class FwdConfig:
    """A forward: one K1 and one K2 that agree on the chunk size."""

    prep: PrepConfig
    recur: RecurConfig

    @property
    def chunk(self) -> int:
        return self.prep.chunk


def supports(cfg: FwdConfig) -> tuple[bool, str]:
    for field in ("chunk", "alongside", "f16", "head_dim_k"):
        k1, k2 = getattr(cfg.prep, field), getattr(cfg.recur, field)
        if k1 != k2:
            return False, f"K1 {field} {k1} != K2 {field} {k2}"
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
    return next((a for a in ALONGSIDE if dataclasses.replace(a.prep, alongside=False) == cfg.prep
                 and dataclasses.replace(a.recur, alongside=False, stages=cfg.recur.stages)
                 == cfg.recur), None)


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
    dims = (recur.head_dim_k, recur.head_dim_v, recur.chunk)
    return next((r for r in RESCALE_RUNS if (r.head_dim_k, r.head_dim_v, r.chunk) == dims), None)


COMBINE: tuple[CombineConfig, ...] = tuple(CombineConfig(d) for d in HEAD_DIMS)
# a varlen forward's offsets (cu_seqlens checked and copied, the chunk slots), on the device
OFFSETS = OffsetsConfig()
# a prefill's checkpoints: K2's tables and the side slots (kda_cute.specs.checkpoints)
CHECKPOINTS = CheckpointsConfig()


def combine_config(head_dim: int) -> CombineConfig | None:
    return next((c for c in COMBINE if c.head_dim_k == head_dim), None)


def select_config(head_dim_k: int, head_dim_v: int, varlen: bool,
                  precision: str = "fast") -> FwdConfig | None:
    """The head-dim / layout ladder: the shipped tensor-core config for (K, V) of `precision`
    ("fast": fp16 products; "precise": bf16 hi/lo products). One config per head dim and
    precision so far (chunk 16, 64 state rows per CTA); `varlen` is accepted for
    layout-specific entries and not used yet."""
    return next((c for c in (FAST if precision == "fast" else PRECISE)
                 if (c.prep.head_dim_k, c.recur.head_dim_v) == (head_dim_k, head_dim_v)), None)


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
        return step_config(p, opts if opts is not None else StepOptions())
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


def all_kernels() -> tuple:
    """Every kernel config that is built and shipped, once each: the forwards' K1 and K2
    (shipped, experimental and alongside builds), then K2's segment runs, WY and checkpoints
    builds, the looped K1s, the rescale runs, the combines, the token steps, the offsets and
    the checkpoints kernel, the replay steps."""
    return tuple(dict.fromkeys(
        [c for f in SHIPPED + EXPERIMENTAL + ALONGSIDE for c in (f.prep, f.recur)]
        + [*SEGMENT_RUNS, *WY_RUNS, *CHECKPOINT_RUNS, *SIDE_PREPS, *RESCALE_RUNS, *COMBINE,
           *step_tiles(), OFFSETS, CHECKPOINTS, *REPLAY, *REPLAY_VARIANTS]))
