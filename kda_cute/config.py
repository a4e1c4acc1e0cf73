"""Tile configs: the one place that names every static kernel parameter.

Shared by the launcher, the AOT build (kernels/build.py) and the tests. No DSL import here: the
runtime must load without the CuTe DSL installed.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import asdict, dataclass


def operand_dtype(f16: bool) -> str:
    """The workspace operands' dtype name: fp16 for the f16 (fast) builds, else bf16."""
    return "float16" if f16 else "bfloat16"


# gate_mode values passed to K1 at run time (one cubin serves all three forms)
GATE_NONE, GATE_BOUNDED, GATE_UNBOUNDED = 0, 1, 2
GATE_MODES = {"none": GATE_NONE, "bounded": GATE_BOUNDED, "unbounded": GATE_UNBOUNDED}

HEAD_DIMS = (64, 128, 256)

# K1's grid: heads on x, chunks on y and z (chunk = y + K1_GRID_Y * z; grid y is at most 65535)
K1_GRID_Y = 65535


@dataclass(frozen=True)
class PrepConfig:
    """K1 (token-parallel preparation)."""

    head_dim_k: int
    chunk: int = 16
    threads: int = 128
    # "f32": fp32 workspace, read by the SIMT K2. "bf16": the tensor-core K2's operands (bf16 qg,
    # kg, Mq; kd and Aw as bf16 hi + lo pairs; fp32 gl), laid out for its TMA loads
    operands: str = "f32"
    # True (bf16 operands): flag each (chunk, head) in the workspace once written, for a K2
    # running alongside (api: K2 first, this K1 its programmatic dependent)
    alongside: bool = False
    # True (bf16 operands): qg, kg, kd, Aw and Mq in fp16, kd, Aw and Mq in their hi planes
    # only (no lo planes written), for a K2 taking one f16 product each (RecurConfig.f16)
    f16: bool = False

    @property
    def name(self) -> str:
        tag = "" if self.operands == "f32" else f"_{self.operands}"
        al = "_al" if self.alongside else ""
        f16 = "_f16" if self.f16 else ""
        return f"kda_prep{tag}_k{self.head_dim_k}_c{self.chunk}_t{self.threads}{f16}{al}"

    @property
    def block_threads(self) -> int:
        return self.threads

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RecurConfig:
    """K2 (chunk recurrence). One CTA per (sequence, head, block of `block_v` state rows)."""

    head_dim_k: int
    head_dim_v: int
    chunk: int = 16
    block_v: int = 16
    threads: int = 128
    stages: int = 2
    mma: str = "simt"  # "simt": fp32 CUDA cores; "wgmma": bf16 warpgroup MMA (hi/lo update)
    # False (wgmma): the state runs only, no output (no Pq and O products, no stores): the
    # segments' runs from zero and from the identity (kda_cute.segments), whose outputs are
    # not used
    outputs: bool = True
    # True (wgmma): K1 runs alongside and flags each (chunk, head); wait for a chunk's flag
    # before loading it
    alongside: bool = False
    # True (wgmma): every product on fp16 operands, one each (K1's qg, kg, kd, Aw and Mq in
    # fp16, no lo planes: PrepConfig.f16; the state converted to fp16 for P and Pq) instead of
    # U, O and the update as three bf16 products of hi/lo splits
    f16: bool = False
    # True (f16): the WY form, U^T = v^T Aw^T + S kgw^T with kgw = -Aw kg formed by the
    # producer warp from each landed stage (no P = S kg^T before U on the serial chain); the
    # launcher takes it where each K2 CTA has its SM to itself (config.WY_RUNS)
    wy: bool = False

    @property
    def name(self) -> str:
        tag = "" if self.mma == "simt" else f"_{self.mma}"
        no = "" if self.outputs else "_noout"
        al = "_al" if self.alongside else ""
        f16 = "_f16" if self.f16 else ""
        wy = "_wy" if self.wy else ""
        return (f"kda_recur{tag}_k{self.head_dim_k}_v{self.head_dim_v}_c{self.chunk}"
                f"_bv{self.block_v}_t{self.threads}_s{self.stages}{f16}{wy}{no}{al}")

    @property
    def block_threads(self) -> int:
        """Threads per CTA: `threads` compute threads, plus one TMA producer warp for wgmma."""
        return self.threads + (32 if self.mma == "wgmma" else 0)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class CombineConfig:
    """The segments' combine (kda_cute.segments) of the few-heads K2: the start states
    S_start(j + 1) = S_start(j) A_j + B_j in fp32. One CTA per (block of `rows` state rows, head,
    sequence), one thread per key column (V = K: segments need K == V)."""

    head_dim_k: int
    rows: int = 8

    @property
    def name(self) -> str:
        return f"kda_combine_k{self.head_dim_k}_r{self.rows}"

    @property
    def block_threads(self) -> int:
        return self.head_dim_k

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class FwdConfig:
    """A forward: one K1 and one K2 that agree on the chunk size."""

    prep: PrepConfig
    recur: RecurConfig

    @property
    def chunk(self) -> int:
        return self.prep.chunk


def supports_prep(cfg: PrepConfig) -> tuple[bool, str]:
    if cfg.head_dim_k % 8 or not 8 <= cfg.head_dim_k <= 256:
        return False, f"head_dim_k must be a multiple of 8 in [8, 256], got {cfg.head_dim_k}"
    if cfg.chunk not in (16, 32):
        return False, f"chunk must be 16 or 32 (phase B's m16 MMA tiles), got {cfg.chunk}"
    if cfg.head_dim_k % 32:
        return False, f"head_dim_k must be a multiple of 32, got {cfg.head_dim_k}"
    tpr = cfg.threads // (2 * cfg.chunk)
    if (cfg.threads < 64 or cfg.threads % (2 * cfg.chunk) or tpr & (tpr - 1) or tpr > 32
            or (cfg.head_dim_k // 8) % tpr):
        return False, (f"threads must be >= 64 and 2*chunk times a power of two dividing "
                       f"head_dim_k / 8 (the row norms read 8-element vectors), "
                       f"got {cfg.threads}")
    if cfg.threads < cfg.head_dim_k:
        # the output pass gives each thread two columns of half the chunk's rows
        return False, (f"threads must be >= head_dim_k {cfg.head_dim_k} (two columns of half "
                       f"the rows per thread), got {cfg.threads}")
    if cfg.operands not in ("f32", "bf16"):
        return False, f"operands must be 'f32' or 'bf16', got {cfg.operands!r}"
    if cfg.alongside and cfg.operands != "bf16":
        return False, f"alongside needs operands 'bf16', got {cfg.operands!r}"
    if cfg.f16 and (cfg.operands != "bf16" or cfg.chunk != 16):
        return False, f"f16 needs operands 'bf16' and chunk 16, got {cfg.operands!r}, {cfg.chunk}"
    return True, ""


def supports_recur(cfg: RecurConfig) -> tuple[bool, str]:
    if cfg.head_dim_k % 8 or not 8 <= cfg.head_dim_k <= 256:
        return False, f"head_dim_k must be a multiple of 8 in [8, 256], got {cfg.head_dim_k}"
    if cfg.head_dim_v % 8 or not 8 <= cfg.head_dim_v <= 256:
        return False, f"head_dim_v must be a multiple of 8 in [8, 256], got {cfg.head_dim_v}"
    if not 1 <= cfg.chunk <= 32:
        return False, f"chunk must be in [1, 32], got {cfg.chunk}"
    if cfg.block_v < 1 or cfg.head_dim_v % cfg.block_v:
        return False, f"block_v {cfg.block_v} must divide head_dim_v {cfg.head_dim_v}"
    if cfg.threads % cfg.block_v or cfg.head_dim_k % (cfg.threads // cfg.block_v):
        return False, (f"threads/block_v ({cfg.threads}/{cfg.block_v}) must divide "
                       f"head_dim_k {cfg.head_dim_k}")
    tpr = cfg.threads // cfg.block_v
    if tpr > 32 or 32 % tpr:
        return False, f"threads per state row (threads/block_v) must be a power of two <= 32, " \
            f"got {tpr}"
    most = 8 if cfg.mma == "wgmma" else 4
    if not 1 <= cfg.stages <= most:
        return False, f"stages must be in [1, {most}] for mma {cfg.mma!r}, got {cfg.stages}"
    if cfg.mma not in ("simt", "wgmma"):
        return False, f"mma must be 'simt' or 'wgmma', got {cfg.mma!r}"
    if not cfg.outputs and cfg.mma != "wgmma":
        return False, f"outputs=False needs mma 'wgmma', got {cfg.mma!r}"
    if cfg.f16 and cfg.mma != "wgmma":
        return False, f"f16 needs mma 'wgmma', got {cfg.mma!r}"
    if cfg.wy and not (cfg.f16 and cfg.outputs and not cfg.alongside and cfg.chunk == 16):
        return False, (f"wy needs f16, outputs, chunk 16 and no alongside, got f16={cfg.f16}, "
                       f"outputs={cfg.outputs}, chunk={cfg.chunk}, alongside={cfg.alongside}")
    if cfg.alongside and (cfg.mma != "wgmma" or not cfg.outputs):
        return False, (f"alongside needs mma 'wgmma' with outputs, got {cfg.mma!r}, "
                       f"outputs={cfg.outputs}")
    if cfg.mma == "wgmma" and (cfg.block_v != 64 or cfg.threads != 128
                               or cfg.head_dim_k % 64 or cfg.chunk not in (16, 32)
                               or cfg.stages < 2):
        return False, (f"mma 'wgmma' needs block_v 64, threads 128, head_dim_k % 64 == 0, "
                       f"chunk 16 or 32 and stages >= 2, got {cfg.block_v}, {cfg.threads}, "
                       f"{cfg.head_dim_k}, {cfg.chunk}, {cfg.stages}")
    return True, ""


def supports_combine(cfg: CombineConfig) -> tuple[bool, str]:
    if cfg.head_dim_k % 32 or not 32 <= cfg.head_dim_k <= 256:
        return False, f"head_dim_k must be a multiple of 32 in [32, 256], got {cfg.head_dim_k}"
    if cfg.rows not in (1, 2, 4, 8, 16) or cfg.head_dim_k % cfg.rows:
        return False, f"rows must be 1, 2, 4, 8 or 16 and divide head_dim_k, got {cfg.rows}"
    return True, ""


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
    for ok, why in (supports_prep(cfg.prep), supports_recur(cfg.recur)):
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
    five, K1 0.293 -> 0.227 ms at B1 T8192 H64 (bench/NOTES.md)."""
    threads = 64 if (k, chunk) == (64, 16) else _prep_threads(k)
    return FwdConfig(PrepConfig(k, chunk, threads, operands="bf16", f16=f16),
                     RecurConfig(k, v, chunk, 64, stages=stages, mma="wgmma", f16=f16))


# The tensor-core forwards: what the ladder picks. "fast" (the default): every K2 product one
# fp16 warpgroup MMA, K1's operands fp16; "precise": the products on bf16 hi/lo splits (three
# MMAs each), the fp32 state at ~5e-6 instead of ~3.5e-4 against float64 (bench/NOTES.md), and
# bf16's range for the values (fp16's overflows past ~6.5e4: README, limits).
FAST: tuple[FwdConfig, ...] = tuple(_tc_fwd(d, d, f16=True) for d in HEAD_DIMS)
PRECISE: tuple[FwdConfig, ...] = tuple(_tc_fwd(d, d) for d in HEAD_DIMS)
TENSOR_CORE: tuple[FwdConfig, ...] = FAST + PRECISE
PRECISIONS = ("fast", "precise")
# The fp32 CUDA-core forwards: the accuracy baseline (fp32 products throughout), reachable with
# fwd(config=...), used by the tests and the benchmark's --simt comparison.
SIMT: tuple[FwdConfig, ...] = tuple(_fwd(d, d) for d in HEAD_DIMS)

# Every config the build ships. The ladder (select_config) only picks from these.
SHIPPED: tuple[FwdConfig, ...] = TENSOR_CORE + SIMT

# Built and ABI-checked like the shipped ones, reachable through fwd(config=...), but not picked by
# the ladder until their GPU tests have passed on the H200: chunk 32 (half the serial steps).
EXPERIMENTAL: tuple[FwdConfig, ...] = (
    tuple(_tc_fwd(d, d, chunk=32, stages=2) for d in HEAD_DIMS))


# The segmented K2's state runs (from zero, and the identity rows): each tensor-core K2 without
# its outputs (the launcher's _segmented_recurrence; segments need K == V).
SEGMENT_RUNS: tuple[RecurConfig, ...] = tuple(
    RecurConfig(**{**f.recur.as_dict(), "outputs": False}) for f in TENSOR_CORE
    if f.recur.head_dim_k == f.recur.head_dim_v)

# K2 in the WY form (RecurConfig.wy), for the fp16 forwards at K >= 128: measured faster only
# where each K2 CTA has an SM to itself (bench/NOTES.md, "The WY form"; api._k2_serial picks it):
# K2 -5 to -6% there, slower with two K2 CTAs on an SM and alongside K1.
WY_RUNS: tuple[RecurConfig, ...] = tuple(
    RecurConfig(**{**f.recur.as_dict(), "wy": True}) for f in TENSOR_CORE
    if f.recur.f16 and f.recur.head_dim_k >= 128)


@functools.lru_cache(maxsize=64)
def wy_of(recur: RecurConfig) -> RecurConfig | None:
    """The WY-form build of a shipped K2 (config.WY_RUNS), or None."""
    w = dataclasses.replace(recur, wy=True)
    return w if w in WY_RUNS else None


# K2 alongside K1 (api._k2_alongside): each tensor-core forward built to run its two kernels at
# once, K1 flagging each (chunk, head) and K2 waiting on the flags (serial forwards carry none
# of that code). K2's shared memory is padded to a whole SM's there, so at K = 64 and 128 it
# streams its chunks through eight stages instead of four (K = 256's take 37 KB a stage).
ALONGSIDE: tuple[FwdConfig, ...] = tuple(
    FwdConfig(PrepConfig(**{**f.prep.as_dict(), "alongside": True}),
              RecurConfig(**{**f.recur.as_dict(), "alongside": True,
                             "stages": 8 if f.recur.head_dim_k <= 128 else f.recur.stages}))
    for f in TENSOR_CORE)
# K1 alongside K2 is held to fewer CTAs per SM than it fits (the launcher pads its shared
# memory): at its full occupancy its memory traffic slows K2's steps, which set the pace. It
# needs about this many CTAs per SM for each (sequence, head) pair per SM left to it (K2
# consumes one chunk of every pair a step); fitted on the H200 (bench/NOTES.md: K = 64 H32 and
# H64, K = 128 H32, K = 256 H16, each the best of a sweep over CTAs per SM; K = 128 re-fitted
# for its fp16 forward, whose faster K2 steps need K1 further ahead: 6 CTAs per SM at H32).
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


# The segments' combine, one per head dim (the segmented K2 runs with K == V).
COMBINE: tuple[CombineConfig, ...] = tuple(CombineConfig(d) for d in HEAD_DIMS)


def combine_config(head_dim: int) -> CombineConfig | None:
    for cfg in COMBINE:
        if cfg.head_dim_k == head_dim:
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
