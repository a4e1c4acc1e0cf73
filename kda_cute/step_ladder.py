"""The token step's tiles (decode, verify, commit, the dense token-by-token forward): which ship,
and which one a step runs (`step_config`, through ladder.config_for). Pure data, as the
ladder."""

from __future__ import annotations

from dataclasses import replace

from .specs import HEAD_DIMS
from .specs.replay import ReplayConfig
from .specs.replay import supports as replay_supports
from .specs.step import WRITE_START, StepConfig
from .specs.step import supports as step_supports


# The token step (decode, verify, commit): per head dim and pool dtype, as many lanes per state
# row as 16-byte pool accesses make a row (at most a warp) and 32 rows per CTA, so many CTAs (and
# their bytes) are in flight on each SM. Other tiles are reachable through StepOptions.config.
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
_SHIPPED = STEP + tuple(c for _, c in STEP_SINGLE + STEP_MULTI + STEP_CHUNK)

# The replay calls (kda_cute.replay, kda_cute.specs.replay), head dims 128: per ring of 8, 16 or
# 32 entries a (slot, head), decode a whole head a CTA (the fewer CTAs read the ring once a
# head), bf16 checkpoints by 8-byte accesses (fewer registers) and on a ring of 32 64 rows a CTA
# (the staged ring's shared memory); flush 64 rows a CTA; commit a CTA a row.
REPLAY_RINGS = (8, 16, 32)
# a decode fold's entries whose decayed keys a thread holds across its rows (ReplayConfig.hoist):
# on the fp32 tiles (their shared memory, not their registers, bounds their CTAs an SM) and the
# bf16 tile of a ring of 16; the other bf16 tiles would lose a CTA an SM to the registers
HOIST = 7


def _replay(pool: str, ring: int, rows: int, **kw) -> ReplayConfig:
    """`rows` rows a CTA (128: a whole head), 32 lanes a row, two threads a row, the row loop
    unrolled by two; bf16 by 8-byte accesses."""
    return ReplayConfig(128, 128, pool, rows, 32, 2 * rows, unroll=2, ring=ring,
                        **({"access": 8} if pool == "bfloat16" else {}), **kw)


# Verify (output-only): the drafts' preparation, the columns and the pairs are a CTA's, so a
# whole head a CTA does them once a head: it ships where the drafts' work outweighs its fewer
# CTAs an SM (16 drafts on a ring of 32; bf16 from 4 drafts); elsewhere 64 rows, up to 8
# drafts on the longer rings in areas of 8 (more CTAs an SM; fp32 with its registers capped to
# four CTAs). The checkpoint's products with the drafts on mma.sync where they outweigh its
# fragment loads: bf16 but for 2 drafts on a ring of 16 (areas of 2, on the CUDA cores), fp32
# on a ring of 32.
REPLAY: tuple[ReplayConfig, ...] = tuple(
    c for n in REPLAY_RINGS for c in (
        _replay("float32", n, 128, hoist=HOIST),
        _replay("bfloat16", n, 64 if n > 16 else 128, hoist=HOIST if n == 16 else 0),
        _replay("float32", n, 128 if n > 16 else 64, mode="verify", mma=n > 16),
        _replay("bfloat16", n, 128 if n > 16 else 64, mode="verify", mma=True),
        _replay("float32", n, 64, mode="flush"),
        _replay("bfloat16", n, 64, mode="flush"),
        _replay("float32", n, 64, mode="commit"),
        *((_replay("float32", n, 64, min_blocks=4, mode="verify", drafts=8),)
          if n > 8 else ()),
        *((_replay("bfloat16", n, 128, mode="verify", drafts=8, mma=True),
           _replay("bfloat16", n, 128, mode="verify", drafts=2)) if n == 16 else ())))
# other replay tiles, for the sweep (bench/replay.py --sweep): decode fp32 64 rows a CTA on
# rings of 16 and 8, 32 rows on a ring of 8; bf16 tiles of 16 lanes a row, and 64 rows; verify
# the whole heads and 64 rows beside the shipped ones, each shipped verify tile's twin with
# the products on the other units, and 2 drafts' areas on a ring of 32 (bf16); each shipped
# decode tile's twin with the other fold (keys held or read a row)
REPLAY_VARIANTS: tuple[ReplayConfig, ...] = (
    *(_replay("float32", n, 64) for n in (16, 8)),
    ReplayConfig(128, 128, "float32", 32, 32, 128, unroll=2, ring=8),
    *(ReplayConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, ring=n) for n in (16, 8)),
    ReplayConfig(128, 128, "bfloat16", 64, 16, 128, unroll=1, ring=8),
    ReplayConfig(128, 128, "bfloat16", 32, 16, 128, unroll=2, ring=8),
    ReplayConfig(128, 128, "bfloat16", 128, 16, 256, unroll=2, ring=8),
    *(_replay("bfloat16", n, 64) for n in (8, 16)),
    _replay("float32", 16, 128, mode="verify", drafts=8),
    _replay("float32", 32, 64, mode="verify"),
    _replay("bfloat16", 16, 64, mode="verify", drafts=8),
    _replay("bfloat16", 32, 64, mode="verify", drafts=8),
    _replay("bfloat16", 32, 64, mode="verify"),
    *(t for t in (replace(c, mma=not c.mma) for c in REPLAY if c.mode == "verify")
      if replay_supports(t)[0]),
    _replay("bfloat16", 32, 128, mode="verify", drafts=2),
    *(replace(c, hoist=0 if c.hoist else HOIST) for c in REPLAY if c.mode == "decode"),
)


def select_replay(head_dim_k: int, head_dim_v: int, pool: str, mode: str, ring: int,
                  tokens: int = 16) -> ReplayConfig | None:
    """REPLAY's tile for (K, V), the checkpoints' dtype name, the call's mode and the ring's
    entries, or None: for a verify of at most `tokens` drafts a row, the tile of the fewest
    drafts' areas that holds them. A commit touches no state: its tile is the ring's alone."""
    fits = [c for c in REPLAY if c.mode == mode and c.ring == ring and (
        mode == "commit" or _dims(c) == (head_dim_k, head_dim_v, pool))
        and (mode != "verify" or tokens <= (c.drafts or min(ring, 16)))]
    return min(fits, key=lambda c: c.drafts or min(ring, 16)) if fits else None


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
    if c not in _SHIPPED)


def step_tiles() -> tuple[StepConfig, ...]:
    """Every built token-step tile once: STEP's, STEP_SINGLE's, then the sweep's variants."""
    return tuple(dict.fromkeys(_SHIPPED + STEP_VARIANTS))


def select_chunk(head_dim_k: int, head_dim_v: int, pool: str, tokens: int) -> StepConfig | None:
    """STEP_CHUNK's tile of the fewest tokens that holds rows of up to `tokens` (at least two)
    for (K, V) and the pool's dtype name, or None (the caller has ruled out tree parents and
    commits)."""
    fits = [(most, c) for most, c in STEP_CHUNK
            if 2 <= tokens <= most and _dims(c) == (head_dim_k, head_dim_v, pool)]
    return min(fits, key=lambda x: x[0])[1] if fits else None


def select_step(head_dim_k: int, head_dim_v: int, pool: str, heads: int = 0,
                persistent: bool = True, tokens: int = 0) -> StepConfig | None:
    """The shipped token-step config for (K, V) and the pool's dtype name, or None. `heads`
    > 0 says the plan is single-token, with that many rows x heads: STEP_SINGLE's tile with
    the largest threshold reached (not a persistent one unless `persistent`: a commit has no
    token), where there is one; else, for a multi-token plan of up to `tokens` tokens a row,
    STEP_MULTI's tile with the largest threshold reached; else STEP's."""
    key = (head_dim_k, head_dim_v, pool)
    if heads > 0:
        table, reached = [(n, c) for n, c in STEP_SINGLE if persistent or not c.persist], heads
    else:
        table, reached = STEP_MULTI, tokens
    fits = [(least, c) for least, c in table if reached >= least and _dims(c) == key]
    if fits:
        return max(fits, key=lambda x: x[0])[1]
    return next((c for c in STEP if _dims(c) == key), None)


def _dims(c: StepConfig) -> tuple[int, int, str]:
    return c.head_dim_k, c.head_dim_v, c.pool


def single_token(p) -> bool:
    """A step of at most one token a row and no tree parents."""
    return p.max_tokens <= 1 and not p.parent.parent_on


def _persistent_ok(p) -> bool:
    """A persistent tile runs rows of one token (no commits, no tree parents)."""
    return single_token(p) and p.max_tokens == 1 and p.write.write_mode != WRITE_START


def _chunk_ok(p, chunk: int) -> bool:
    """A chunked tile runs rows of at most `chunk` tokens, without tree parents or commits."""
    return p.max_tokens <= chunk and not p.parent.parent_on and p.write.write_mode != WRITE_START


def step_config(p, opts) -> StepConfig:
    """The step's config: StepOptions.config checked against the step, or the ladder's tile
    (ladder.config_for says which)."""
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
    if not ok or _dims(cfg) != (p.K, p.V, p.pool):
        raise ValueError(f"config: expected a StepConfig for K={p.K}, V={p.V}, pool {p.pool}, "
                         f"got {why or cfg.name}")
    return cfg
