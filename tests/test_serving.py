"""The serving calls: decode, verify and commit against a state pool.

On a CPU: their argument checks (each bad input named), the StepProblem and plan each call makes
(grids from shapes only, the sources of absent tables, the single-token shared-memory trim), and
fla's call's refusals.

On the H200 (the tests marked gpu): token by token against the float64 reference. Every pool is
filled with a sentinel value first; after a call every slot the call may not write is checked
bit-identical, and every output row of a padding row is checked zero. Pools sit inside a larger
buffer whose guard regions are poisoned and checked untouched."""

import inspect
import re

import pytest
import torch

import kda_cute
from kda_cute import launch, memo, serving
from kda_cute.checks import step as step_checks
from kda_cute.plans.step import step_plan
from kda_cute.plans.steps import At, Errors, Role
from kda_cute.reference import preprocess, rel_err
from kda_cute.specs.step import (
    E_READ,
    E_WRITE,
    WRITE_ALL,
    WRITE_LAST,
    WRITE_START,
    StepConfig,
    supports,
)
from kda_cute.step_ladder import STEP, select_step
from kda_cute.testing import SENTINEL
from kda_cute.testing import bits as _bits
from kda_cute.testing import guarded as _guarded
from kda_cute.testing import guards_ok as _guards_ok
from tests.mutations import ODD, must_refuse, odd_swaps, outcome, tensor_swaps

BF = torch.bfloat16
H, K = 4, 128


@pytest.fixture
def planned(monkeypatch):
    """The calls' plans, made on a CPU (the device check skipped): the last one is kept."""
    got = {}

    def fake(c, dev):
        p, opts = c.problem, c.options
        got["plan"] = step_plan(p, opts)
        return got["plan"]

    monkeypatch.setattr(step_checks, "on_cuda", lambda dev, what: None)
    monkeypatch.setattr(serving, "_plan", fake)
    monkeypatch.setattr(serving, "_launch", lambda *a: None)
    monkeypatch.setattr(serving, "_again", lambda *a: False)
    memo.clear()
    yield got
    memo.clear()


def tok(*lead, d=K):
    return torch.randn(*lead, H, d).to(BF)


def decode_args(B=8, slots=32, dtype=torch.float32):
    return (tok(B, 1), tok(B, 1), tok(B, 1), tok(B, 1), torch.randn(B, 1, H).to(BF),
            torch.zeros(slots, H, K, K, dtype=dtype), torch.arange(B, dtype=torch.int32))


def test_single_token_tiles_by_width():
    """STEP_SINGLE: from each threshold of rows x heads on, its tile; below all, STEP's."""
    from kda_cute.step_ladder import STEP_SINGLE
    by = {}
    for least, cfg in STEP_SINGLE:
        by.setdefault((cfg.head_dim_k, cfg.pool), []).append((least, cfg))
    assert by, "no single-token tiles"
    for (d, pool), tiles in by.items():
        tiles.sort(key=lambda t: t[0])
        plain = next(c for c in STEP if (c.head_dim_k, c.pool) == (d, pool))
        assert select_step(d, d, pool, tiles[0][0] - 1) == plain
        assert select_step(d, d, pool, 0) == plain  # 0: not a single-token plan
        for i, (least, cfg) in enumerate(tiles):
            assert select_step(d, d, pool, least) == cfg
            top = tiles[i + 1][0] - 1 if i + 1 < len(tiles) else 10 ** 6
            assert select_step(d, d, pool, top) == cfg
            assert cfg.min_blocks * cfg.threads <= 2048 and supports(cfg) == (True, "")
    # bf16 at K = 128: a persistent 64-row tile, then a whole head from 6144 rows x heads
    assert select_step(128, 128, "bfloat16", 6144).block_v == 128
    assert select_step(128, 128, "bfloat16", 6143).persist
    assert not select_step(128, 128, "bfloat16", 0).persist


def test_single_token_tiles_for_single_tokens_only(planned):
    from kda_cute.step_ladder import STEP_SINGLE
    single = {c for _, c in STEP_SINGLE}
    B, slots = 6144 // H, 2 * 6144 // H
    kda_cute.decode(*decode_args(B, slots, BF), lower_bound=-5.0)
    assert planned["plan"].launches()[0].kernel.block_v == 128
    assert planned["plan"].launches()[0].kernel in single
    kda_cute.decode(*decode_args(64, 128, BF), lower_bound=-5.0)
    assert planned["plan"].launches()[0].kernel.persist
    kda_cute.decode(*decode_args(4, 8, BF), lower_bound=-5.0)  # small grids: small tiles
    assert planned["plan"].launches()[0].kernel.block_v == 16
    # a commit (no token) never takes a persistent tile
    kda_cute.commit(torch.zeros(16, H, K, K, dtype=BF), torch.zeros(8, 2, H, K, K, dtype=BF),
                    torch.arange(8, dtype=torch.int32), torch.zeros(8, dtype=torch.int32))
    assert not planned["plan"].launches()[0].kernel.persist
    assert not select_step(128, 128, "bfloat16", 64 * H, persistent=False).persist
    q = tok(B, 2)
    kda_cute.verify(q, q, q, q, torch.randn(B, 2, H).to(BF), torch.zeros(slots, H, K, K, dtype=BF),
                    ssm_state_indices=torch.zeros(B, 2, dtype=torch.int32), lower_bound=-5.0)
    got = planned["plan"].launches()[0].kernel
    assert got not in single and got.chunk == 2


def test_multi_token_tiles_by_tokens(planned):
    """STEP_MULTI: a multi-token plan whose rows may hold at least its threshold of tokens, and
    more than the chunked tiles take, takes its tile (a verify of 9 tokens a row, a bf16 pool);
    fewer tokens, another pool or a single-token plan take the others."""
    from kda_cute.step_ladder import STEP_MULTI
    assert STEP_MULTI
    for least, cfg in STEP_MULTI:
        d, pool = cfg.head_dim_k, cfg.pool
        assert supports(cfg) == (True, "") and cfg.prep
        assert select_step(d, d, pool, 0, tokens=least) == cfg
        assert select_step(d, d, pool, 0, tokens=least - 1) in STEP
        assert select_step(d, d, pool, 0, tokens=least - 1) != cfg
        assert select_step(d, d, pool, 64, tokens=least) != cfg  # single-token plans
    B, slots = 8, 64
    for t in (9, 16):
        q = tok(B, t)
        kda_cute.verify(q, q, q, q, torch.randn(B, t, H).to(BF),
                        torch.zeros(slots, H, K, K, dtype=BF),
                        ssm_state_indices=torch.zeros(B, t, dtype=torch.int32), lower_bound=-5.0)
        assert planned["plan"].launches()[0].kernel == STEP_MULTI[0][1]
    q = tok(B, 4)
    kda_cute.verify(q, q, q, q, torch.randn(B, 4, H).to(BF), torch.zeros(slots, H, K, K),
                    ssm_state_indices=torch.zeros(B, 4, dtype=torch.int32), lower_bound=-5.0)
    assert planned["plan"].launches()[0].kernel in STEP  # an fp32 pool


def test_chunk_tiles_by_tokens(planned):
    """STEP_CHUNK: a bf16 verify of chains (style (a), with or without accepted counts or
    cu_seqlens; style (b) without tree parents) of 2-8 tokens a row takes the chunked tile of
    the fewest tokens that holds them; tree drafts, commits, single tokens, more tokens or an
    fp32 pool take the others."""
    from kda_cute.step_ladder import STEP_CHUNK, STEP_MULTI, STEP_SINGLE, select_chunk
    assert [m for m, _ in STEP_CHUNK] == [2, 4, 8]
    for most, cfg in STEP_CHUNK:
        assert cfg.chunk == most and supports(cfg) == (True, "")
    for t, most in ((2, 2), (3, 4), (4, 4), (5, 8), (8, 8)):
        assert select_chunk(128, 128, "bfloat16", t).chunk == most
    assert select_chunk(128, 128, "bfloat16", 9) is None
    assert select_chunk(128, 128, "bfloat16", 1) is None
    assert select_chunk(128, 128, "float32", 4) is None
    assert select_chunk(64, 64, "bfloat16", 4) is None
    B, slots = 8, 64

    def kernel():
        return planned["plan"].launches()[0].kernel

    for t in range(2, 9):  # style (a)
        q = tok(B, t)
        kda_cute.verify(q, q, q, q, torch.randn(B, t, H).to(BF),
                        torch.zeros(slots, H, K, K, dtype=BF),
                        ssm_state_indices=torch.zeros(B, t, dtype=torch.int32),
                        num_accepted_tokens=torch.ones(B, dtype=torch.int32), lower_bound=-5.0)
        assert kernel() == select_chunk(128, 128, "bfloat16", t), t
    q = tok(1, 10)  # varlen: rows of up to 3 tokens (ssm_state_indices' columns)
    kda_cute.verify(q, q, q, q, torch.randn(1, 10, H).to(BF),
                    torch.zeros(slots, H, K, K, dtype=BF),
                    cu_seqlens=torch.tensor([0, 3, 5, 8, 10], dtype=torch.int32),
                    ssm_state_indices=torch.zeros(4, 3, dtype=torch.int32), lower_bound=-5.0)
    assert kernel().chunk == 4
    pool = torch.zeros(slots, H, K, K, dtype=BF)
    for t, parents, want in ((3, False, 4), (3, True, 0), (5, True, 0)):  # style (b)
        q = tok(B, t)
        kda_cute.verify(q, q, q, q, torch.randn(B, t, H).to(BF), pool,
                        state_indices=torch.zeros(B, dtype=torch.int32),
                        intermediate_states=torch.zeros(B, t, H, K, K, dtype=BF),
                        retrieve_parent_token=torch.full((B, t), -1, dtype=torch.int64)
                        if parents else None, lower_bound=-5.0)
        assert kernel().chunk == want, (t, parents)
    assert kernel() == STEP_MULTI[0][1]  # a tree of 5 tokens a row
    kda_cute.commit(pool, torch.zeros(B, 2, H, K, K, dtype=BF),
                    torch.arange(B, dtype=torch.int32), torch.zeros(B, dtype=torch.int32))
    assert not kernel().chunk
    q = tok(B, 1)
    kda_cute.verify(q, q, q, q, torch.randn(B, 1, H).to(BF), pool,
                    ssm_state_indices=torch.zeros(B, 1, dtype=torch.int32), lower_bound=-5.0)
    assert kernel() in {c for _, c in STEP_SINGLE} | set(STEP)
    q = tok(B, 4)
    kda_cute.verify(q, q, q, q, torch.randn(B, 4, H).to(BF), torch.zeros(slots, H, K, K),
                    ssm_state_indices=torch.zeros(B, 4, dtype=torch.int32), lower_bound=-5.0)
    assert kernel() in STEP  # an fp32 pool


def test_shipped_step_configs_supported():
    for c in STEP:
        assert supports(c) == (True, ""), c.name
    for d in (64, 128, 256):
        for p in ("float32", "bfloat16"):
            assert select_step(d, d, p) is not None
    assert select_step(96, 96, "float32") is None


def test_decode_plan(planned):
    kda_cute.decode(*decode_args(), lower_bound=-5.0)
    pl = planned["plan"]
    (st,) = pl.launches()
    cfg = st.kernel
    assert st.grid == (K // cfg.block_v, H, 8)
    assert st.source("accepted") == Errors() and st.source("parent") == Errors()
    assert st.source("read_index") == Role("read_index")
    assert st.source("write_index") == Role("write_index")
    assert st.source("write_mode").value == WRITE_LAST
    assert st.smem <= cfg.stage_bytes  # one token per row: the staging area only
    assert "decode" in pl.describe()


def test_decode_grid_from_shapes_only(planned):
    """Indices, lengths and counts do not enter the plan: the same shapes give the same plan."""
    a = decode_args()
    kda_cute.decode(*a, lower_bound=-5.0)
    first = planned["plan"]
    b = list(decode_args())
    b[6] = torch.tensor([5, -1, 3, 0, 31, 7, 2, 9], dtype=torch.int32)
    kda_cute.decode(*b, lower_bound=-5.0)
    assert planned["plan"] is first


def test_decode_without_indices_reads_the_ramp(planned):
    a = decode_args()
    kda_cute.decode(*a[:6], lower_bound=-5.0)
    st = planned["plan"].launches()[0]
    assert isinstance(st.source("read_index"), At) and st.source("read_index").buffer.kind == "ramp"
    assert st.source("r_sn").value == 1


def test_verify_styles(planned):
    N, S1 = 4, 3
    q = tok(N, S1)
    beta = torch.randn(N, S1, H).to(BF)
    pool = torch.zeros(32, H, K, K)
    idx = torch.zeros(N, S1, dtype=torch.int64)
    kda_cute.verify(q, q, q, q, beta, pool, ssm_state_indices=idx,
                    num_accepted_tokens=torch.ones(N, dtype=torch.int32), lower_bound=-5.0)
    p = planned["plan"].problem
    assert p.form == "verify" and p.write[0] == WRITE_ALL and p.read[3] == 1  # int64: wide
    assert p.accepted[0] == 1 and p.max_tokens == S1
    assert planned["plan"].launches()[0].smem == STEP[2].block_v * K * 4  # fp32 pool stages
    inter = torch.zeros(N, S1, H, K, K)
    kda_cute.verify(q, q, q, q, beta, pool, state_indices=idx[:, 0].contiguous(),
                    intermediate_states=inter,
                    retrieve_parent_token=torch.zeros(N, S1, dtype=torch.int32), gate="none")
    p = planned["plan"].problem
    assert p.form == "verify scratch" and p.write[4:] == (S1, 1) and p.parent[0] == 1
    assert p.null_min == (0, 0) and p.dst_rows == N * S1


def test_commit_problem(planned):
    N, S = 4, 3
    pool = torch.zeros(32, H, K, K, dtype=BF)
    inter = torch.zeros(N, S, H, K, K, dtype=BF)
    kda_cute.commit(pool, inter, torch.arange(N, dtype=torch.int32),
                    torch.zeros(N, dtype=torch.int32), null_slot=0)
    p = planned["plan"].problem
    assert p.form == "commit" and p.T == 0 and p.write[0] == WRITE_START
    assert p.read[4:] == (S, 1) and p.accepted[2:4] == (0, 1)  # step, negative skips
    assert p.null_min == (0, 1)  # the scratch row 0 is a row, slot 0 is padding


def _raises(fn, exc, match):
    with pytest.raises(exc, match=match):
        fn()


BAD_DECODE = [
    ("q dtype", lambda a: (a[0].float(), *a[1:]), TypeError, "q: expected dtype bfloat16"),
    ("k shape", lambda a: (a[0], tok(8, 1, d=64), *a[2:]), ValueError, "k: expected shape"),
    ("two tokens", lambda a: (*(tok(8, 2) for _ in range(4)), torch.randn(8, 2, H).to(BF),
                              *a[5:]), ValueError, "q: expected one token per row"),
    ("beta shape", lambda a: (*a[:4], torch.randn(8, 1, H + 1).to(BF), *a[5:]), ValueError,
     "beta: expected shape"),
    ("pool dtype", lambda a: (*a[:5], a[5].double(), a[6]), TypeError, "state: expected dtype"),
    ("pool inner", lambda a: (*a[:5], torch.zeros(32, H, K, K + 8)[..., :K], a[6]), ValueError,
     "state: expected each slot's"),
    ("index dtype", lambda a: (*a[:6], a[6].float()), TypeError, "state_indices: expected dtype"),
    ("index shape", lambda a: (*a[:6], a[6][:3]), ValueError, "state_indices: expected shape"),
    ("k overlap", lambda a: (a[0], torch.zeros(8, 1, H * K + 8).to(BF)[:, :, :H * K].view(
        8, 1, H, K)[:, :, :, :].as_strided((8, 1, H, K), (64, 64, K, 1)), *a[2:]), ValueError,
     "k: expected a token stride >= H"),
]


@pytest.mark.parametrize("case", BAD_DECODE, ids=lambda c: c[0])
def test_decode_bad_metadata_named(case, planned):
    _, edit, exc, match = case
    _raises(lambda: kda_cute.decode(*edit(decode_args()), lower_bound=-5.0), exc, match)


def test_decode_bad_options_named(planned):
    a = decode_args()
    _raises(lambda: kda_cute.decode(*a), ValueError, "lower_bound: expected a float")
    _raises(lambda: kda_cute.decode(*a, gate="sigmoid"), ValueError, "gate: expected one of")
    _raises(lambda: kda_cute.decode(*a, gate="unbounded"), ValueError, "A_log: expected")
    _raises(lambda: kda_cute.decode(*a, lower_bound=-5.0, null_slot=3), ValueError, "null_slot")
    _raises(lambda: kda_cute.decode(*a, lower_bound=-5.0, scale=-1.0), ValueError, "scale")
    _raises(lambda: kda_cute.decode(*a, lower_bound=-5.0, dt_bias=torch.zeros(3)), ValueError,
            "dt_bias")
    _raises(lambda: kda_cute.decode(*a[:6], lower_bound=-5.0, has_initial_state=torch.ones(3)),
            TypeError, "has_initial_state")
    small = list(decode_args(slots=4))
    _raises(lambda: kda_cute.decode(*small[:6], lower_bound=-5.0), ValueError,
            "state: expected at least B = 8 slots")


def test_on_cpu_the_device_is_named():
    memo.clear()
    _raises(lambda: kda_cute.decode(*decode_args(), lower_bound=-5.0), ValueError,
            "q: expected a CUDA tensor")


def test_verify_bad_metadata_named(planned):
    N, S1 = 4, 3
    q = tok(N, S1)
    beta = torch.randn(N, S1, H).to(BF)
    pool = torch.zeros(32, H, K, K)
    idx = torch.zeros(N, S1, dtype=torch.int32)
    _raises(lambda: kda_cute.verify(q, q, q, q, beta, pool, gate="none"), ValueError,
            "ssm_state_indices: expected given")
    _raises(lambda: kda_cute.verify(q, q, q, q, beta, pool, ssm_state_indices=idx[:, :2],
                                    gate="none"), ValueError, "q: expected at most 2 tokens")
    _raises(lambda: kda_cute.verify(q, q, q, q, beta, pool, ssm_state_indices=idx,
                                    num_accepted_tokens=torch.ones(N + 1, dtype=torch.int32),
                                    gate="none"), ValueError, "num_accepted_tokens")
    inter = torch.zeros(N, S1, H, K, K, dtype=BF)
    _raises(lambda: kda_cute.verify(q, q, q, q, beta, pool, state_indices=idx[:, 0],
                                    intermediate_states=inter, gate="none"), ValueError,
            "intermediate_states: expected the pool's dtype")
    _raises(lambda: kda_cute.verify(q, q, q, q, beta, pool, ssm_state_indices=idx,
                                    retrieve_parent_token=idx, gate="none"), ValueError,
            "retrieve_parent_token: expected tree drafts with intermediate_states")
    _raises(lambda: kda_cute.verify(q, q, q, q, beta, pool, ssm_state_indices=idx,
                                    cu_seqlens=torch.zeros(N + 1, dtype=torch.int32),
                                    gate="none"), ValueError, "q: expected batch size 1")


def test_fla_call_refusals(planned):
    B = 4
    q = tok(B, 1)
    beta = torch.randn(B, 1, H).to(BF)
    pool = torch.zeros(8, H, K, K)
    idx = torch.arange(B, dtype=torch.int32)
    f = kda_cute.fused_recurrent_kda_fwd
    _raises(lambda: f(q, q, q, q, beta, initial_state=pool, ssm_state_indices=idx, bogus=1),
            TypeError, "unknown arguments")
    _raises(lambda: f(q, q, q, q, beta, initial_state=pool, ssm_state_indices=idx,
                      state_v_first=True, allow_neg_eigval=True), ValueError, "allow_neg_eigval")
    _raises(lambda: f(q, q, q, q, beta, initial_state=pool, ssm_state_indices=idx),
            ValueError, "state_v_first")
    _raises(lambda: f(q, q, tok(B, 1).repeat(1, 1, 2, 1), q, beta, initial_state=pool,
                      ssm_state_indices=idx, state_v_first=True), ValueError, "GVA")
    _raises(lambda: f(q, q, q, q, q, initial_state=pool, ssm_state_indices=idx,
                      state_v_first=True), ValueError, "headwise beta")
    out, st = f(q, q, q, q, beta, initial_state=pool, ssm_state_indices=idx, state_v_first=True)
    assert st is pool and out.shape == q.shape
    assert planned["plan"].problem.form == "verify"


def test_persistent_tile_plan(planned):
    """A persistent tile: a grid of CTAs per SM x SMs (at most one a tile), rows and heads as
    kernel parameters, refused by multi-token plans."""
    from kda_cute.specs.step import args as step_args
    from kda_cute.step_ladder import step_tiles
    cfg = next(c for c in step_tiles() if c.persist and c.head_dim_k == K
               and c.pool == "bfloat16")
    names = [a.name for a in step_args(cfg) if not a.grid_only]
    assert "num_rows" in names and "num_heads" in names
    plain = next(c for c in STEP if c.head_dim_k == K and c.pool == "bfloat16")
    assert "num_rows" not in [a.name for a in step_args(plain) if not a.grid_only]
    assert cfg.stage_bytes == 2 * cfg.block_v * K * 2
    for B in (8, 1000):
        kda_cute.decode(*decode_args(B, B + 4, BF), lower_bound=-5.0, config=cfg)
        launch = planned["plan"].launches()[0]
        tiles = K // cfg.block_v * H * B
        assert launch.grid == (min(tiles, 132 * cfg.persist), 1, 1)
        assert launch.smem == cfg.stage_bytes
        src = dict(zip(launch.args, launch.sources, strict=True))
        assert (src["num_rows"].value, src["num_heads"].value) == (B, H)
    q = tok(4, 2)
    with pytest.raises(ValueError, match="config: a persistent tile"):
        kda_cute.verify(q, q, q, q, torch.randn(4, 2, H).to(BF), torch.zeros(8, H, K, K, dtype=BF),
                        ssm_state_indices=torch.zeros(4, 2, dtype=torch.int32),
                        lower_bound=-5.0, config=cfg)


def test_step_config_refusals():
    """A row's lanes hold the v of its rows between them (rows_per_thread <= tpr); loads issued
    a step ahead (ahead) are for the one-tile kernel, not the persistent one (which issues its
    next tile's loads anyway)."""
    ok, why = supports(StepConfig(128, 128, "float32", 64, 2, 32))
    assert not ok and "rows_per_thread" in why
    ok, why = supports(StepConfig(128, 128, "bfloat16", 64, 16, 128, persist=6, ahead=True))
    assert not ok and "ahead" in why
    assert supports(StepConfig(128, 128, "bfloat16", 64, 16, 128, ahead=True)) == (True, "")
    assert StepConfig(128, 128, "bfloat16", 64, 16, 128, ahead=True).name.endswith("_n")


def test_step_prep_config():
    """A tile that prepares chunks of tokens (prep): one row group a token, the one-tile kernel
    without ahead; its area sits in the part of shared memory a single-token plan keeps."""
    c = StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, prep=4)
    assert supports(c) == (True, "") and c.name.endswith("_u2_c4")
    assert c.prep_bytes == 3 * 4 * 4 * 128 + 4 * 4 * 64 + 128 + 128
    assert c.stage_bytes == 64 * 128 * 2 + c.prep_bytes
    assert StepConfig(128, 128, "bfloat16", 64, 16, 128).prep_bytes == 0
    for bad, word in ((dict(persist=5), "prep"), (dict(ahead=True), "prep"),
                      (dict(prep=9), "prep must be in"), (dict(prep=1), "whole warps")):
        ok, why = supports(StepConfig(128, 128, "bfloat16", 64, 16, 128,
                                      **{"prep": 4, **bad}))
        assert not ok and word in why, (bad, why)


def test_step_chunk_config(planned):
    """The chunked tile (a row's tokens as one chunk, products by warp MMA): 16 rows a warp,
    bf16 or fp32 pools (the tile and the operand planes in the pool's dtype, rows 16 bytes
    longer than K); its shared memory (chunk_bytes, what the build's manifest says) kept whole
    even by a single-token plan; refused by plans with rows of more tokens than its chunk, tree
    parents or a commit."""
    from kda_cute import cubin

    c = StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, chunk=8)
    assert supports(c) == (True, "") and c.name.endswith("_u2_k8")
    assert c.stage_bytes == c.chunk_bytes
    for ch in (2, 4, 8):  # the built cubins' (make kernels runs before the tests)
        for pool in ("bfloat16", "float32"):
            cc = StepConfig(128, 128, pool, 64, 16, 128, unroll=2, chunk=ch)
            assert cubin.manifest(cc.name, "sm_90a")["dynamic_smem_bytes"] == cc.chunk_bytes, ch
    f2 = StepConfig(128, 128, "float32", 64, 16, 128, unroll=2, chunk=2)
    assert (f2.chunk_bytes - StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2,
                                        chunk=2).chunk_bytes
            == 64 * (128 * 4 - 128 * 2) + 2 * 8 * (128 * 4 - 128 * 2))  # tile, planes
    for bad, word in ((dict(access=8), "16-byte accesses"),
                      (dict(prep=4), "without prep"), (dict(ahead=True), "without prep"),
                      (dict(chunk=1), "chunk must be in"), (dict(chunk=9), "chunk must be in"),
                      (dict(block_v=32), "16 rows a warp")):
        ok, why = supports(StepConfig(**{**dict(head_dim_k=128, head_dim_v=128,
                                                  pool="bfloat16", block_v=64, tpr=16,
                                                  threads=128, unroll=2, chunk=8), **bad}))
        assert not ok and word in why, (bad, why)
    c4 = StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, chunk=4)
    for B in (3, 200):  # a decode keeps the whole storage
        kda_cute.decode(*decode_args(B, B + 4, BF), lower_bound=-5.0, config=c4)
        assert planned["plan"].launches()[0].smem == c4.chunk_bytes
    q = tok(4, 4)
    pool = torch.zeros(32, H, K, K, dtype=BF)
    b = torch.randn(4, 4, H).to(BF)
    kda_cute.verify(q, q, q, q, b, pool, ssm_state_indices=torch.zeros(4, 4, dtype=torch.int32),
                    lower_bound=-5.0, config=c4)
    assert planned["plan"].launches()[0].kernel.name == c4.name
    q5 = tok(4, 5)
    with pytest.raises(ValueError, match="config: a chunked tile"):
        kda_cute.verify(q5, q5, q5, q5, torch.randn(4, 5, H).to(BF), pool,
                        ssm_state_indices=torch.zeros(4, 5, dtype=torch.int32),
                        lower_bound=-5.0, config=c4)
    # persistent (two tiles staged): a grid of persist CTAs an SM, rows and heads as kernel
    # parameters, on decode and on verify alike
    cp = StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, chunk=2, persist=5)
    assert supports(cp) == (True, "") and cp.name.endswith("_u2_p5_k2")
    assert cp.chunk_bytes - StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2,
                                       chunk=2).chunk_bytes == 64 * (128 + 8) * 2
    assert cubin.manifest(cp.name, "sm_90a")["dynamic_smem_bytes"] == cp.chunk_bytes
    for B in (3, 200):
        kda_cute.decode(*decode_args(B, B + 4, BF), lower_bound=-5.0, config=cp)
        launch = planned["plan"].launches()[0]
        assert launch.grid == (min(2 * H * B, 132 * 5), 1, 1) and launch.smem == cp.chunk_bytes
        src = dict(zip(launch.args, launch.sources, strict=True))
        assert (src["num_rows"].value, src["num_heads"].value) == (B, H)
    q2 = tok(4, 2)
    kda_cute.verify(q2, q2, q2, q2, torch.randn(4, 2, H).to(BF), pool,
                    ssm_state_indices=torch.zeros(4, 2, dtype=torch.int32), lower_bound=-5.0,
                    config=cp)
    assert planned["plan"].launches()[0].kernel.name == cp.name
    with pytest.raises(ValueError, match="config: a chunked tile"):
        kda_cute.verify(q, q, q, q, b, pool, ssm_state_indices=torch.zeros(4, 4, dtype=torch.int32),
                        lower_bound=-5.0, config=cp)
    inter = torch.zeros(4, 4, H, K, K, dtype=BF)
    with pytest.raises(ValueError, match="config: a chunked tile.*tree parents"):
        kda_cute.verify(q, q, q, q, b, pool, state_indices=torch.zeros(4, dtype=torch.int32),
                        intermediate_states=inter,
                        retrieve_parent_token=torch.full((4, 4), -1, dtype=torch.int64),
                        lower_bound=-5.0, config=c4)


def test_error_words_name_the_argument_and_clear():
    """kda_cute.errors: a word set by a kernel is raised once, naming its argument; a
    forward's non-finite state is named `precision` without the bad-index wording."""
    from kda_cute import errors
    from kda_cute.specs.offsets import E_PREFILL_CU
    from kda_cute.specs.step import E_ACCEPTED, ERRORS

    _, view = errors.words(0)
    for i in range(len(view)):
        view[i] = 0
    errors.raise_pending(0)  # nothing set: no error
    view[errors.E_NONFINITE] = 1
    with pytest.raises(errors.DeviceValueError) as info:
        errors.raise_pending(0)
    msg = str(info.value)
    assert msg.startswith("precision") and "out-of-range" not in msg
    errors.raise_pending(0)  # cleared
    view[E_PREFILL_CU] = 1
    with pytest.raises(errors.DeviceValueError) as info:
        errors.raise_pending(0)
    msg = str(info.value)
    assert msg.startswith("cu_seqlens (a prefill") and "padding" not in msg
    # a word set names the argument the calls planned on the device passed for it
    errors.forget()
    view[E_READ] = 1
    with pytest.raises(errors.DeviceValueError) as info:
        errors.raise_pending(0)
    assert str(info.value).startswith(ERRORS[E_READ])  # none noted: the word's description
    errors.note(0, "decode", ((E_READ, "state_indices"),))
    view[E_READ] = 1
    with pytest.raises(errors.DeviceValueError) as info:
        errors.raise_pending(0)
    assert str(info.value).startswith("state_indices (decode's read slot): expected")
    errors.note(0, "commit", ((E_READ, "intermediate_state_indices"),))
    view[E_READ] = view[E_ACCEPTED] = 1
    with pytest.raises(errors.DeviceValueError) as info:
        errors.raise_pending(0)
    assert str(info.value).startswith(
        f"{ERRORS[E_ACCEPTED]}, state_indices (decode's read slot) or "
        "intermediate_state_indices (commit's read slot): expected")
    errors.forget()


def test_each_call_notes_the_arguments_behind_its_error_words(planned):
    """Planned on a CPU, each serving call's checks name the table it was given for each
    error word: decode's state_indices / output_state_indices, verify's ssm_state_indices (a)
    or state_indices / intermediate_state_indices / retrieve_parent_token (b), commit's."""
    q, k, v, g, beta, pool, idx = decode_args()[:7]
    names = step_checks.decode(q, k, v, g, beta, pool, idx, None, None, None, None, None, None,
                               None, "none", True, True, None, None).names
    assert dict(names) == {E_READ: "state_indices", E_WRITE: "state_indices"}
    out_idx = torch.arange(idx.shape[0], dtype=torch.int64)
    names = step_checks.decode(q, k, v, g, beta, pool, None, None, out_idx, None, None, None,
                               None, None, "none", True, True, None, None).names
    assert dict(names) == {E_WRITE: "output_state_indices"}


# ------------------------------------------------------------ every tensor argument, mutated
def _fuzz_calls():
    """Each serving entry's valid call (B 3 rows, T 2 tokens where it takes several), by
    keyword: (function, positional names, keywords)."""
    B, T, d = 3, 2, 64

    def t(*lead):
        return torch.randn(*lead, H, d).to(BF)

    def ints(*s, off=0):
        return (torch.arange(int(torch.tensor(s).prod())) + off).to(torch.int32).view(*s)

    gates = dict(A_log=torch.randn(H), dt_bias=torch.randn(H, d), lower_bound=-5.0)
    tokens = ("q", "k", "v", "g", "beta")

    def toks(T_):
        return dict(q=t(B, T_), k=t(B, T_), v=t(B, T_), g=t(B, T_),
                    beta=torch.randn(B, T_, H).to(BF), out=t(B, T_))

    return {
        "decode": (kda_cute.decode, (*tokens, "state", "state_indices"), dict(
            **toks(1), state=torch.randn(8, H, d, d), state_indices=ints(B),
            output_state_indices=ints(B, off=3), has_initial_state=torch.ones(B, dtype=bool),
            **gates)),
        "verify": (kda_cute.verify, (*tokens, "state"), dict(
            **toks(T), state=torch.randn(9, H, d, d), ssm_state_indices=ints(B, T),
            num_accepted_tokens=torch.ones(B, dtype=torch.int32), **gates)),
        "verify-scratch": (kda_cute.verify, (*tokens, "state"), dict(
            **toks(T), state=torch.randn(9, H, d, d), state_indices=ints(B),
            intermediate_states=torch.randn(B, T, H, d, d), intermediate_state_indices=ints(B),
            retrieve_parent_token=torch.tensor([[-1, 0]] * B, dtype=torch.int32), **gates)),
        "commit": (kda_cute.commit, ("state", "intermediate_states", "state_indices",
                                     "accepted_step"), dict(
            state=torch.randn(9, H, d, d), intermediate_states=torch.randn(B, T, H, d, d),
            state_indices=ints(B), accepted_step=torch.ones(B, dtype=torch.int32),
            intermediate_state_indices=ints(B))),
        "recurrent": (serving.recurrent, tokens, dict(
            **toks(T), initial_state=torch.randn(B, H, d, d),
            final_state=torch.randn(B, H, d, d), **gates)),
        # fla's call: through verify (the pool) and recurrent (dense K-first states)
        "fla-pool": (kda_cute.fused_recurrent_kda_fwd, tokens, dict(
            **toks(T), initial_state=torch.randn(9, H, d, d), state_v_first=True,
            ssm_state_indices=ints(B, T), num_accepted_tokens=torch.ones(B, dtype=torch.int32),
            use_gate_in_kernel=True, A_log=gates["A_log"], dt_bias=gates["dt_bias"].flatten(),
            lower_bound=-5.0)),
        "fla-dense": (kda_cute.fused_recurrent_kda_fwd, tokens, dict(
            **toks(T), initial_state=torch.randn(B, H, d, d), inplace_final_state=False,
            output_final_state=True)),
    }


def _names(entry: str, fn) -> set:
    names = set(inspect.signature(fn).parameters)
    if entry.startswith("fla"):  # (fla's call names the arguments of the call it makes)
        names |= set(inspect.signature(kda_cute.verify).parameters)
        names |= set(inspect.signature(serving.recurrent).parameters)
    return names


ENTRIES = ["decode", "verify", "verify-scratch", "commit", "recurrent", "fla-pool", "fla-dense"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_tensor_argument_mutated(entry, planned):
    """Each tensor argument of a valid call replaced by each of tests/mutations.py's values:
    the call either goes through (the plan made) or raises TypeError / ValueError whose message
    starts with the names of the call's own arguments; never another exception. What
    mutations.must_refuse names (a token tensor of another dtype, rank or size, an index table
    of floating point values, a sparse tensor) is always refused."""
    fn, positional, kw = _fuzz_calls()[entry]
    names = _names(entry, fn)
    assert outcome(fn, kw, names, positional) is None
    refused = 0
    for arg, what, bad in tensor_swaps(kw):
        if outcome(fn, bad, names, positional, (arg, what)) is not None:
            refused += 1
        else:
            assert not must_refuse(arg, what), f"{entry}: {arg} ({what}) accepted"
    assert refused > 20


def test_a_remembered_call_does_not_pass_a_bool_for_a_number(planned):
    """The memo keys scalars with their types: after scale=1 (valid), scale=True (a bool,
    refused) is checked, not taken for the remembered call."""
    a = decode_args()
    kda_cute.decode(*a, lower_bound=-5.0, scale=1)
    _raises(lambda: kda_cute.decode(*a, lower_bound=-5.0, scale=True), ValueError, "scale")
    kda_cute.commit(torch.zeros(9, H, K, K), torch.zeros(8, 2, H, K, K),
                    torch.arange(8, dtype=torch.int32), torch.ones(8, dtype=torch.int32),
                    null_slot=0)
    _raises(lambda: kda_cute.commit(torch.zeros(9, H, K, K), torch.zeros(8, 2, H, K, K),
                                    torch.arange(8, dtype=torch.int32),
                                    torch.ones(8, dtype=torch.int32), null_slot=False),
            ValueError, "null_slot")


@pytest.mark.parametrize("entry", ENTRIES)
def test_every_argument_given_odd_values(entry, planned):
    """Each keyword argument of a valid call (tensor or not) given each of mutations.ODD: a
    TypeError / ValueError naming the call's arguments, or the call goes through; never another
    exception (an AttributeError of a value taken for a tensor or a config)."""
    fn, positional, kw = _fuzz_calls()[entry]
    names = _names(entry, fn)
    for arg, odd, bad in odd_swaps(fn, kw, positional):
        outcome(fn, bad, names, positional, (arg, odd))


def test_check_errors_arguments_named():
    """check_errors' device (None, an index, a torch.device or "cuda:N") and sync (a switch):
    anything else a named TypeError / ValueError (values that need no GPU to judge)."""
    for odd in [v for v in ODD if v is not None and not isinstance(v, bool)
                and not (isinstance(v, int) and v >= 0)] + ["cpu", "bogus", torch.device("cpu")]:
        with pytest.raises((TypeError, ValueError), match="^device: expected"):
            kda_cute.check_errors(device=odd)
    switches = (None, True, False, 0, 1)  # (what flag takes)
    for odd in ODD:
        if any(odd is w or (type(odd) is type(w) and odd == w) for w in switches):
            continue
        with pytest.raises(TypeError, match="^sync: expected a bool"):
            kda_cute.check_errors(device=0, sync=odd)


@pytest.mark.parametrize("a_dt, b_dt", [(torch.float32, torch.float32), (BF, torch.float16),
                                        (torch.float16, None), (None, BF)])
def test_gate_param_dtypes_reach_the_step_kernel(planned, a_dt, b_dt):
    """A_log and dt_bias in fp32, bf16 or fp16 (or not given): the step kernel is told how each
    is held (abi.GATE_PARAM_DTYPES; 0: not given, read as zeros) and reads the caller's tensor;
    the gate "none" reads neither. float64 is refused, naming the argument."""
    from kda_cute.abi import GATE_PARAM_DTYPES
    code = {None: 0, **{getattr(torch, n): c for n, c in GATE_PARAM_DTYPES.items()}}
    a = None if a_dt is None else torch.randn(H).to(a_dt)
    b = None if b_dt is None else torch.randn(H * K).to(b_dt)
    kda_cute.decode(*decode_args(), A_log=a, dt_bias=b, lower_bound=-5.0)
    src = dict(zip(planned["plan"].launches()[0].args,
                   planned["plan"].launches()[0].sources, strict=True))
    assert (src["a_log_dtype"].value, src["dt_bias_dtype"].value) == (code[a_dt], code[b_dt])
    assert isinstance(src["A_log"], Role if a is not None else At)
    kda_cute.decode(*decode_args(), A_log=a, dt_bias=b, gate="none")
    src = dict(zip(planned["plan"].launches()[0].args,
                   planned["plan"].launches()[0].sources, strict=True))
    assert (src["a_log_dtype"].value, src["dt_bias_dtype"].value) == (0, 0)
    for name in ("A_log", "dt_bias"):
        bad = {"A_log": a, "dt_bias": b, name: torch.randn(H if name == "A_log" else H * K,
                                                           dtype=torch.float64)}
        with pytest.raises(TypeError, match=f"^{name}: expected dtype float32 or bfloat16 or "
                                            "float16, got float64"):
            kda_cute.decode(*decode_args(), **bad, lower_bound=-5.0)


# On the GPU: each test below is marked gpu (tests/conftest.py skips it where the kernels
# cannot run).

OUT_TOL = 3.5e-3  # bf16 output rounding alone is ~1.7e-3
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-3}


def _tokens(R, H, K, V, gate, seed, lead=None):
    """q, k, g, v, beta of R token rows [R, H, D] (or `lead` + [H, D])."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lead = lead or (R,)

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    q, k = rnd(*lead, H, K), rnd(*lead, H, K)
    g = rnd(*lead, H, K) if gate != "none" else (
        -torch.rand(*lead, H, K, generator=gen, device="cuda") * 0.5).to(torch.bfloat16)
    v, beta = rnd(*lead, H, V), rnd(*lead, H)
    A_log = torch.randn(H, generator=gen, device="cuda") * 0.5
    dt_bias = torch.randn(H * K, generator=gen, device="cuda") * 0.5
    return q, k, g, v, beta, A_log, dt_bias


def _steps(q, k, g, v, beta, S0, gate, A_log, dt_bias, lb, scale, parents=None, **flags):
    """float64: outputs [L, H, V] and the states after each token [L, H, V, K] of one row whose
    tokens are q.. [L, H, *] from S0 [H, V, K] (parents: token t starts from parent's state;
    flags: qk_l2norm, beta_sigmoid)."""
    L = q.shape[0]
    qn, kn, a, b = preprocess(q[None], k[None], g[None], beta[None], A_log=A_log,
                              dt_bias=dt_bias, lower_bound=lb, gate=gate, **flags)
    qn, kn, a, b = qn[0], kn[0], a[0], b[0]
    v = v.double()
    S = S0.double()
    outs, states = [], []
    for t in range(L):
        if parents is not None and t > 0 and parents[t] != t - 1:
            S = S0.double() if parents[t] < 0 else states[parents[t]]
        S = S * torch.exp(a[t])[:, None, :]
        e = v[t] - (S @ kn[t][:, :, None])[..., 0]
        S = S + b[t][:, None, None] * e[..., None] * kn[t][:, None, :]
        outs.append(scale * (S @ qn[t][:, :, None])[..., 0])
        states.append(S)
    return torch.stack(outs) if L else v.new_zeros(0), states


def _check_rows(out, pool, before, idx, acc, cu, lens, tokens, pads, dtype, gate, A_log,
                dt_bias, lb, first_slot=0, **flags):
    """A style (a) verify's rows against float64: rows `pads` (padding) output zeros; every other
    row starts from slot idx[n, acc[n] - 1] of `before`, and its outputs and the state after each
    of its tokens (into slot idx[n, t]; entries below first_slot skipped) are checked. Returns
    the slots written."""
    q, k, g, v, beta = tokens
    written = set()
    for n, L in enumerate(lens):
        rows = slice(int(cu[n]), int(cu[n]) + L)
        if L == 0:
            continue
        if n in pads:
            assert (out[rows] == 0).all()
            continue
        o, states = _steps(q[rows], k[rows], g[rows], v[rows], beta[rows],
                           before[idx[n, acc[n] - 1]], gate, A_log, dt_bias, lb,
                           q.shape[-1] ** -0.5, **flags)
        assert rel_err(out[rows], o) < OUT_TOL, n
        for t in range(L):
            s = int(idx[n, t])
            if s >= first_slot:
                assert rel_err(pool[s], states[t]) < STATE_TOL[dtype], (n, t)
                written.add(s)
    return written


def _kw(gate, A_log, dt_bias):
    return dict(A_log=A_log if gate != "none" else None,
                dt_bias=dt_bias if gate != "none" else None,
                lower_bound=-5.0 if gate == "bounded" else None, gate=gate)


CASES = [(K, dt, gate) for K in (64, 128, 256) for dt in (torch.float32, torch.bfloat16)
         for gate in ("bounded", "unbounded", "none")]


@pytest.mark.gpu
@pytest.mark.parametrize("K,dtype,gate", CASES, ids=lambda x: str(x).replace("torch.", ""))
@pytest.mark.parametrize("null", [False, True], ids=["pad-1", "null0"])
def test_decode(K, dtype, gate, null):
    B, H, slots = 12, 4, 64
    q, k, g, v, beta, A_log, dt_bias = _tokens(B, H, K, K, gate, seed=K + len(gate))
    pool, buf = _guarded((slots, H, K, K), dtype)
    gen = torch.Generator(device="cuda").manual_seed(1)
    live = torch.randn(slots, H, K, K, generator=gen, device="cuda").to(dtype) * 0.3
    perm = torch.randperm(slots - 1, generator=gen, device="cuda")[:2 * B] + 1
    read, write = perm[:B].clone(), perm[B:].clone()
    pool[read] = live[read]
    pad_rows = [1, 7]
    read[pad_rows] = 0 if null else -1
    idx = read.to(torch.int32)
    before = pool.clone()
    out = torch.full((B, H, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    kda_cute.decode(q, k, v, g, beta, pool, idx, out=out, output_state_indices=write,
                    null_slot=0 if null else None, **_kw(gate, A_log, dt_bias))
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    lb = -5.0 if gate == "bounded" else None
    scale = K ** -0.5
    for n in range(B):
        if n in pad_rows:
            assert (out[n] == 0).all()
            continue
        o, states = _steps(q[n:n + 1], k[n:n + 1], g[n:n + 1], v[n:n + 1], beta[n:n + 1],
                           before[read[n]], gate, A_log, dt_bias, lb, scale)
        assert rel_err(out[n], o[0]) < OUT_TOL
        assert rel_err(pool[write[n]], states[-1]) < STATE_TOL[dtype]
    written = set(write[[n for n in range(B) if n not in pad_rows]].tolist())
    untouched = [s for s in range(slots) if s not in written]
    assert torch.equal(pool[untouched].view(torch.int16 if dtype == torch.bfloat16 else
                                            torch.int32),
                       before[untouched].view(torch.int16 if dtype == torch.bfloat16 else
                                              torch.int32))
    assert _guards_ok(buf)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_mixed_qkv_in_place(dtype):
    """q, k, v as row-strided views of one projection, g and beta likewise, a packed output,
    int64 indices and the update in place."""
    B, H, K = 9, 3, 128
    gen = torch.Generator(device="cuda").manual_seed(5)
    width = 3 * H * K + 8
    mixed = torch.randn(B, width, generator=gen, device="cuda").to(torch.bfloat16)
    q = mixed[:, :H * K].view(B, H, K)
    k = mixed[:, H * K:2 * H * K].view(B, H, K)
    v = mixed[:, 2 * H * K:3 * H * K].view(B, H, K)
    gb = torch.randn(B, H * K + 16, generator=gen, device="cuda").to(torch.bfloat16)
    g = gb[:, :H * K].view(B, H, K)
    beta = gb[:, H * K:H * K + H]
    A_log = torch.randn(H, generator=gen, device="cuda") * 0.5
    pool, buf = _guarded((20, H, K, K), dtype)
    pool.copy_((torch.randn(20, H, K, K, generator=gen, device="cuda") * 0.3).to(dtype))
    before = pool.clone()
    idx = torch.tensor([3, 0, 19, 5, -1, 7, 11, 2, 13], dtype=torch.int64, device="cuda")
    out = torch.full((B, H * K), float("nan"), dtype=torch.bfloat16, device="cuda")
    kda_cute.decode(q, k, v, g, beta, pool, idx, out=out, A_log=A_log, gate="unbounded")
    kda_cute.check_errors(sync=True)
    for n in range(B):
        if idx[n] < 0:
            assert (out[n] == 0).all()
            continue
        o, st = _steps(q[n:n + 1], k[n:n + 1], g[n:n + 1], v[n:n + 1], beta[n:n + 1],
                       before[idx[n]], "unbounded", A_log, None, None, K ** -0.5)
        assert rel_err(out[n].view(H, K), o[0]) < OUT_TOL
        assert rel_err(pool[idx[n]], st[-1]) < STATE_TOL[dtype]
    rest = [s for s in range(20) if s not in idx.tolist()]
    assert torch.equal(_bits(pool[rest]), _bits(before[rest]))
    assert _guards_ok(buf)


def _prep_tile(dtype):
    """A tile whose row groups prepare chunks of 4 tokens together (StepConfig.prep)."""
    from kda_cute.specs.step import StepConfig
    if dtype == torch.float32:
        return StepConfig(128, 128, "float32", 32, 32, 128, unroll=2, prep=4)
    return StepConfig(128, 128, "bfloat16", 64, 16, 128, unroll=2, prep=4)


def _chunk_tile(dtype):
    """The chunked tile: a row's tokens (up to 8) as one chunk (StepConfig.chunk)."""
    from kda_cute.specs.step import StepConfig
    pool = "float32" if dtype == torch.float32 else "bfloat16"
    return StepConfig(128, 128, pool, 64, 16, 128, unroll=2, chunk=8)


def _tile(tile, dtype):
    """The config a test runs: the plan's (ladder), a prep tile, or the chunked tile."""
    return {"ladder": {}, "prep": dict(config=_prep_tile(dtype)),
            "chunk": dict(config=_chunk_tile(dtype))}[tile]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
@pytest.mark.parametrize("tile", ["ladder", "prep", "chunk"])
def test_verify_slot_per_token(dtype, varlen, tile):
    """Style (a): ssm_state_indices [N, 1+S], num_accepted_tokens; the start slot is one of the
    write slots (read before any write); padding entries are skipped, padding rows output
    zeros; varlen rows of 0 .. 1+S tokens. `prep`: a tile that prepares chunks of 4 tokens,
    with rows of up to 7 (two chunks); `chunk`: the chunked tile (rows of up to 8 as one
    chunk), rows of up to 7."""
    cfg = _tile(tile, dtype)
    prep = tile != "ladder"
    N, S1, H, K = 10, 7 if prep else 4, 4, 128
    gate = "bounded"
    gen = torch.Generator(device="cuda").manual_seed(11)
    lens = [S1] * N if not varlen else [4, 0, 1, 3, 4, 2, 0, 4, 1, 3]
    if varlen and prep:
        lens = [7, 0, 1, 5, 4, 2, 0, 7, 1, 6]
    Ttot = sum(lens)
    q, k, g, v, beta, A_log, dt_bias = _tokens(Ttot, H, K, K, gate, seed=3)
    slots = 4 * N * S1
    pool, buf = _guarded((slots, H, K, K), dtype)
    perm = torch.randperm(slots, generator=gen, device="cuda")[:N * S1].view(N, S1)
    idx = perm.to(torch.int32).clone()
    acc = torch.randint(1, S1 + 1, (N,), generator=gen, device="cuda", dtype=torch.int32)
    for n in range(N):  # the start slots hold live states
        pool[idx[n, acc[n] - 1]] = (torch.randn(H, K, K, generator=gen, device="cuda")
                                    * 0.3).to(dtype)
    idx[2, :] = -1  # a padding row
    idx[4, 3] = -1  # a skipped entry
    acc[4] = min(int(acc[4]), 3)
    before = pool.clone()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    if varlen:
        args = (q, k, v, g, beta)
        out = torch.full((Ttot, H, K), float("nan"), dtype=torch.bfloat16, device="cuda")
        kw = dict(cu_seqlens=cu)
    else:
        args = tuple(x.view(N, S1, *x.shape[1:]) for x in (q, k, v, g, beta))
        out = torch.full((N, S1, H, K), float("nan"), dtype=torch.bfloat16, device="cuda")
        kw = {}
    kda_cute.verify(*args, pool, ssm_state_indices=idx, num_accepted_tokens=acc, out=out,
                    **kw, **cfg, **_kw(gate, A_log, dt_bias))
    kda_cute.check_errors(sync=True)
    written = _check_rows(out.view(Ttot, H, K), pool, before, idx, acc, cu, lens,
                          (q, k, g, v, beta), {2}, dtype, gate, A_log, dt_bias, -5.0)
    rest = [s for s in range(slots) if s not in written]
    assert torch.equal(_bits(pool[rest]), _bits(before[rest]))
    assert _guards_ok(buf)


@pytest.mark.gpu
@pytest.mark.parametrize("K,tpr,chunk,pool", [
    (128, 16, 2, "bfloat16"), (128, 16, 4, "bfloat16"), (128, 16, 8, "bfloat16"),
    (64, 8, 4, "bfloat16"), (64, 8, 8, "bfloat16"), (256, 16, 2, "bfloat16"),
    (256, 16, 8, "bfloat16"), (128, 16, 2, "float32"), (128, 16, 4, "float32"),
    (128, 16, 8, "float32")])
@pytest.mark.parametrize("form", ["bounded", "unbounded", "none", "raw"])
def test_chunk_tiles_forms(K, tpr, chunk, pool, form):
    """Chunked tiles (rows of up to 2, 4, 8 tokens as one chunk; K = 64, 128, 256; bf16 pools,
    and fp32 ones at K = 128) over every gate form and "raw" (gate none, q and k not normed,
    beta as given): q, k, v as row-strided views of one projection, g and beta of another,
    int64 indices with null_slot=0 (a padding row, a skipped entry), varlen rows of 0 .. chunk
    tokens, accepted counts, and a row whose decays underflow fp32 over its tokens."""
    from kda_cute.specs.step import StepConfig
    cfg = StepConfig(K, K, pool, 64, tpr, 128, unroll=2, chunk=chunk)
    dtype = getattr(torch, pool)
    gate = "none" if form == "raw" else form
    flags = dict(qk_l2norm=False, beta_sigmoid=False) if form == "raw" else {}
    H = 3
    lens = [chunk, 0, chunk, 1, chunk, max(1, chunk - 1), chunk, chunk // 2]
    N, Ttot = len(lens), sum(lens)
    gen = torch.Generator(device="cuda").manual_seed(90 + chunk)
    width = 3 * H * K + 24
    mixed = torch.randn(Ttot, width, generator=gen, device="cuda").to(torch.bfloat16)
    if form == "raw":
        mixed[:, :2 * H * K] *= 0.9 / K ** 0.5  # |q|, |k| about 0.9
    q, k, v = (mixed[:, i * H * K:(i + 1) * H * K].view(Ttot, H, K) for i in range(3))
    gb = torch.randn(Ttot, H * K + 16, generator=gen, device="cuda")
    if gate == "none":
        gb[:, :H * K] = -torch.rand(Ttot, H * K, generator=gen, device="cuda") * 0.5
    if form == "raw":
        gb[:, H * K + 8:H * K + 8 + H] = torch.rand(Ttot, H, generator=gen, device="cuda")
    gb = gb.to(torch.bfloat16)
    g = gb[:, :H * K].view(Ttot, H, K)
    beta = gb[:, H * K + 8:H * K + 8 + H]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    t6 = int(cu[6])
    if gate == "none":  # row 6: exp(-40) a token, below fp32's range after three
        g[t6:t6 + lens[6]] = -40.0
    A_log = torch.randn(H, generator=gen, device="cuda") * 0.5
    dt_bias = torch.randn(H * K, generator=gen, device="cuda") * 0.5
    slots = 4 * N * chunk + 1
    pool, buf = _guarded((slots, H, K, K), dtype)
    idx = (1 + torch.randperm(slots - 1, generator=gen, device="cuda")[:N * chunk]).view(
        N, chunk).to(torch.int64)
    acc = torch.randint(1, chunk + 1, (N,), generator=gen, device="cuda", dtype=torch.int32)
    for n in range(N):
        pool[idx[n, acc[n] - 1]] = (torch.randn(H, K, K, generator=gen, device="cuda")
                                    * 0.3).to(dtype)
    idx[2, :] = 0  # a padding row (null_slot=0)
    if chunk > 2:
        idx[4, 1] = 0  # a skipped entry
        acc[4] = 1
    before = pool.clone()
    out = torch.full((Ttot, H * K), float("nan"), dtype=torch.bfloat16, device="cuda")
    kw = _kw(gate, A_log, dt_bias)
    kda_cute.verify(q, k, v, g, beta, pool, cu_seqlens=cu, ssm_state_indices=idx,
                    num_accepted_tokens=acc, out=out, null_slot=0, config=cfg, **kw, **flags)
    kda_cute.check_errors(sync=True)
    written = _check_rows(out.view(Ttot, H, K), pool, before, idx, acc, cu, lens,
                          (q, k, g, v, beta), {2}, dtype, gate, A_log, dt_bias,
                          kw["lower_bound"], first_slot=1, **flags)
    rest = [s for s in range(slots) if s not in written]
    assert torch.equal(_bits(pool[rest]), _bits(before[rest]))
    assert _guards_ok(buf)


def _chunk_persistent():
    from kda_cute.step_ladder import step_tiles
    return [c for c in step_tiles() if c.chunk and c.persist]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _chunk_persistent(), ids=lambda c: c.name)
def test_chunk_persistent_verify(cfg):
    """A persistent chunked tile (bf16 and fp32 pools) on a verify of more tiles than its CTAs
    several times over (each CTA walks several, staging the next while it computes this one):
    varlen rows of 0 .. chunk tokens, accepted counts, padding rows."""
    N, H, K, S1 = 300, 4, 128, cfg.chunk
    dtype = getattr(torch, cfg.pool)
    assert K // cfg.block_v * H * N > 132 * cfg.persist, "every CTA should run several tiles"
    gen = torch.Generator(device="cuda").manual_seed(95)
    lens = torch.randint(0, S1 + 1, (N,), generator=gen, device="cuda").tolist()
    lens[0] = S1
    Ttot = sum(lens)
    q, k, g, v, beta, A_log, dt_bias = _tokens(Ttot, H, K, K, "bounded", seed=96)
    slots = N * S1 + 8
    pool, buf = _guarded((slots, H, K, K), dtype)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:N * S1].view(N, S1).to(
        torch.int32)
    acc = torch.randint(1, S1 + 1, (N,), generator=gen, device="cuda", dtype=torch.int32)
    for n in range(N):
        pool[idx[n, acc[n] - 1]] = (torch.randn(H, K, K, generator=gen, device="cuda")
                                    * 0.3).to(dtype)
    pads = {7, 150, 299}
    for n in pads:
        idx[n, :] = -1
    before = pool.clone()
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32,
                      device="cuda")
    out = torch.full((Ttot, H, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    kda_cute.verify(q, k, v, g, beta, pool, cu_seqlens=cu, ssm_state_indices=idx,
                    num_accepted_tokens=acc, out=out, config=cfg,
                    **_kw("bounded", A_log, dt_bias))
    kda_cute.check_errors(sync=True)
    written = _check_rows(out, pool, before, idx, acc, cu, lens, (q, k, g, v, beta), pads,
                          dtype, "bounded", A_log, dt_bias, -5.0)
    rest = [s for s in range(slots) if s not in written]
    assert torch.equal(_bits(pool[rest]), _bits(before[rest]))
    assert _guards_ok(buf)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("tile", ["ladder", "prep", "chunk"])
def test_verify_scratch_and_commit(dtype, tree, tile):
    """Style (b): the pool is read only, the state after each token goes to the scratch;
    tree drafts start tokens from their parents; commit copies the accepted step. `prep`: a
    tile that prepares chunks of 4 tokens (the 5 tokens a row take two); `chunk`: the chunked
    tile (chains only: it refuses tree parents)."""
    if tile == "chunk" and tree:
        pytest.skip("the chunked tile refuses tree parents (CPU test)")
    cfg = _tile(tile, dtype)
    N, S, H, K = 6, 5, 2, 128
    gate = "unbounded"
    gen = torch.Generator(device="cuda").manual_seed(21)
    q, k, g, v, beta, A_log, dt_bias = _tokens(N * S, H, K, K, gate, seed=4, lead=(N, S))
    slots = 32
    pool, buf = _guarded((slots, H, K, K), dtype)
    pool.copy_((torch.randn(slots, H, K, K, generator=gen, device="cuda") * 0.3).to(dtype))
    before = pool.clone()
    sidx = torch.randperm(slots, generator=gen, device="cuda")[:N].to(torch.int32)
    sidx[3] = -1
    R = N + 3
    inter, ibuf = _guarded((R, S, H, K, K), dtype)
    iidx = torch.randperm(R, generator=gen, device="cuda")[:N].to(torch.int32)
    parents = None
    if tree:
        par = [[-1, 0, 0, 1, 2], [-1, -1, 1, 2, 0], [-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0],
               [-1, 0, 1, 1, 3], [-1, 0, 0, 2, 2]]
        parents = torch.tensor(par, dtype=torch.int64, device="cuda")
    out = torch.full((N, S, H, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    kda_cute.verify(q, k, v, g, beta, pool, state_indices=sidx, intermediate_states=inter,
                    intermediate_state_indices=iidx, retrieve_parent_token=parents, out=out,
                    **cfg, **_kw(gate, A_log, dt_bias))
    kda_cute.check_errors(sync=True)
    assert torch.equal(_bits(pool), _bits(before))
    for n in range(N):
        if n == 3:
            assert (out[n] == 0).all()
            assert (inter[iidx[n]] == SENTINEL).all()
            continue
        o, states = _steps(q[n], k[n], g[n], v[n], beta[n], before[sidx[n]], gate, A_log,
                           dt_bias, None, K ** -0.5, parents[n].tolist() if tree else None)
        assert rel_err(out[n], o) < OUT_TOL, n
        for t in range(S):
            assert rel_err(inter[iidx[n], t], states[t]) < STATE_TOL[dtype], (n, t)
    step = torch.tensor([2, -1, 4, 1, 0, 3], dtype=torch.int32, device="cuda")
    kda_cute.commit(pool, inter, sidx, step, iidx)
    kda_cute.check_errors(sync=True)
    for n in range(N):
        s = int(sidx[n])
        if s < 0:
            continue
        want = before[s] if step[n] < 0 else inter[iidx[n], step[n]]
        assert torch.equal(_bits(pool[s]), _bits(want)), n
    rest = [s for s in range(slots) if s not in sidx.tolist()]
    assert torch.equal(_bits(pool[rest]), _bits(before[rest]))
    assert _guards_ok(buf) and _guards_ok(ibuf)


@pytest.mark.gpu
def test_fla_compatible_call():
    """fused_recurrent_kda_fwd with fla's argument names: decode in place through 1-D
    ssm_state_indices, and the dense form; unknown arguments raise."""
    B, H, K = 5, 4, 128
    q, k, g, v, beta, A_log, dt_bias = _tokens(B, H, K, K, "bounded", seed=8, lead=(1, B))
    q, k, g, v, beta = (x.view(B, 1, *x.shape[2:]) for x in (q, k, g, v, beta))
    pool = (torch.randn(16, H, K, K, device="cuda") * 0.3)
    before = pool.clone()
    idx = torch.tensor([4, 9, 1, 15, 0], dtype=torch.int32, device="cuda")
    out, st = kda_cute.fused_recurrent_kda_fwd(
        q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, initial_state=pool, state_v_first=True,
        ssm_state_indices=idx, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
    torch.cuda.synchronize()
    assert st is pool
    for n in range(B):
        o, states = _steps(q[n], k[n], g[n], v[n], beta[n], before[idx[n]], "bounded", A_log,
                           dt_bias, -5.0, K ** -0.5)
        assert rel_err(out[n, 0], o[0]) < OUT_TOL
        assert rel_err(pool[idx[n]], states[-1]) < STATE_TOL[torch.float32]
    # dense: T = 3 tokens per sequence, a new fp32 final state
    q3, k3, g3, v3, b3, *_ = _tokens(B * 3, H, K, K, "none", seed=9, lead=(B, 3))
    s0 = torch.randn(B, H, K, K, device="cuda") * 0.3
    o3, s1 = kda_cute.fused_recurrent_kda_fwd(
        q3, k3, v3, g3, b3, initial_state=s0, output_final_state=True,
        inplace_final_state=False, state_v_first=True, use_qk_l2norm_in_kernel=True,
        use_beta_sigmoid_in_kernel=True)
    for n in range(B):
        o, states = _steps(q3[n], k3[n], g3[n], v3[n], b3[n], s0[n], "none", None, None, None,
                           K ** -0.5)
        assert rel_err(o3[n], o) < OUT_TOL
        assert rel_err(s1[n], states[-1]) < STATE_TOL[torch.float32]
    with pytest.raises(TypeError, match="unknown arguments"):
        kda_cute.fused_recurrent_kda_fwd(q, k, v, g, beta, initial_state=pool,
                                         state_v_first=True, ssm_state_indices=idx, foo=1)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_graph_replay_new_indices_and_counts(dtype):
    """A verify captured once, replayed with new slots, counts and lengths in the same
    buffers: each replay matches an eager call on the same values (a bf16 pool: the chunked
    tile)."""
    N, S1, H, K = 8, 3, 4, 128
    gen = torch.Generator(device="cuda").manual_seed(31)
    q, k, g, v, beta, A_log, dt_bias = _tokens(N * S1, H, K, K, "bounded", seed=12)
    slots = 64
    pool = (torch.randn(slots, H, K, K, device="cuda") * 0.3).to(dtype)
    idx = torch.zeros(N, S1, dtype=torch.int32, device="cuda")
    acc = torch.ones(N, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, N * S1 + 1, S1, dtype=torch.int32, device="cuda")
    out = torch.zeros(N * S1, H, K, dtype=torch.bfloat16, device="cuda")
    kw = _kw("bounded", A_log, dt_bias)

    def call(p, o):
        kda_cute.verify(q, k, v, g, beta, p, cu_seqlens=cu, ssm_state_indices=idx,
                        num_accepted_tokens=acc, out=o, **kw)

    call(pool.clone(), out)  # warm: kernels loaded, plan made
    torch.cuda.synchronize()
    graph_pool = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(graph_pool, out)
    for r in range(3):
        idx.copy_(torch.randperm(slots, generator=gen, device="cuda")[:N * S1].view(N, S1))
        acc.copy_(torch.randint(1, S1 + 1, (N,), generator=gen, device="cuda"))
        lens = torch.randint(0, S1 + 1, (N,), generator=gen, device="cuda")
        cu.copy_(torch.cat([cu.new_zeros(1), lens.cumsum(0)]).to(torch.int32))
        graph_pool.copy_(pool)
        out.fill_(float("nan"))
        graph.replay()
        got_out, got_pool = out.clone(), graph_pool.clone()
        eager_pool = pool.clone()
        out.fill_(float("nan"))
        call(eager_pool, out)
        torch.cuda.synchronize()
        n_tok = int(cu[-1])
        assert torch.equal(got_out[:n_tok], out[:n_tok]), r
        assert torch.equal(got_pool, eager_pool), r
    kda_cute.check_errors(sync=True)


@pytest.mark.gpu
def test_four_streams():
    """Four decodes on four streams at once, each on its own slots of one pool."""
    B, H, K = 16, 8, 128
    pool = torch.randn(4 * B, H, K, K, device="cuda") * 0.3
    before = pool.clone()
    ins = [_tokens(B, H, K, K, "none", seed=40 + i) for i in range(4)]
    streams = [torch.cuda.Stream() for _ in range(4)]
    outs = []
    torch.cuda.synchronize()
    for i, s in enumerate(streams):
        q, k, g, v, beta, *_ = ins[i]
        idx = torch.arange(i * B, (i + 1) * B, dtype=torch.int32, device="cuda")
        with torch.cuda.stream(s):
            outs.append(kda_cute.decode(q, k, v, g, beta, pool, idx, gate="none", stream=s))
    torch.cuda.synchronize()
    for i in range(4):
        q, k, g, v, beta, *_ = ins[i]
        for n in (0, B - 1):
            o, st = _steps(q[n:n + 1], k[n:n + 1], g[n:n + 1], v[n:n + 1], beta[n:n + 1],
                           before[i * B + n], "none", None, None, None, K ** -0.5)
            assert rel_err(outs[i][n], o[0]) < OUT_TOL
            assert rel_err(pool[i * B + n], st[-1]) < STATE_TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("bad", ["read", "write", "accepted", "cu", "parent", "wide"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_bad_values_reported_and_contained(bad, dtype):
    """A bad index / count / offset value touches nothing outside the tensors (poisoned guard
    regions), makes its row padding, and is reported by check_errors naming the argument (fp32
    at K = 64; a bf16 pool at K = 128: the chunked tile, but for tree parents)."""
    N, S1, H = 4, 3, 2
    K = 64 if dtype == torch.float32 else 128
    q, k, g, v, beta, *_ = _tokens(N * S1, H, K, K, "none", seed=50)
    pool, buf = _guarded((16, H, K, K), dtype)
    kda_cute.check_errors(sync=True)
    before = pool.clone()
    idx = torch.arange(N * S1, dtype=torch.int32, device="cuda").view(N, S1)
    acc = torch.ones(N, dtype=torch.int32, device="cuda")
    cu = torch.arange(0, N * S1 + 1, S1, dtype=torch.int32, device="cuda")
    kw = dict(gate="none", ssm_state_indices=idx, num_accepted_tokens=acc, cu_seqlens=cu)
    kda_cute.clear_caches()  # (only this call's names noted)
    name = {"read": "ssm_state_indices (verify's read slot)",
            "write": "ssm_state_indices (verify's write slot)",
            "accepted": "num_accepted_tokens (verify's accepted count)",
            "cu": "cu_seqlens (verify's offsets)",
            "parent": "retrieve_parent_token (verify's parent)",
            "wide": "ssm_state_indices (verify's read slot)"}[bad]
    if bad == "read":
        idx[1, 0] = 1 << 30
    elif bad == "write":
        idx[1, 2] = 16
    elif bad == "accepted":
        acc[2] = 7
    elif bad == "cu":
        cu[2] = 100
    elif bad == "wide":
        idx64 = idx.to(torch.int64)
        idx64[1, 0] = (1 << 32) + 3  # the low word alone would look valid
        kw["ssm_state_indices"] = idx64
    if bad == "parent":
        inter, ibuf = _guarded((N, S1, H, K, K), dtype)
        par = torch.tensor([[-1, 0, 5]] * N, dtype=torch.int32, device="cuda")
        kda_cute.verify(q, k, v, g, beta, pool, state_indices=idx[:, 0].contiguous(),
                        intermediate_states=inter, retrieve_parent_token=par, gate="none",
                        cu_seqlens=cu)
        assert _guards_ok(ibuf)
    else:
        kda_cute.verify(q, k, v, g, beta, pool, **kw)
    with pytest.raises(kda_cute.DeviceValueError, match="^" + re.escape(name) + ": expected"):
        kda_cute.check_errors(sync=True)
    kda_cute.check_errors(sync=True)  # cleared once reported
    assert _guards_ok(buf)
    del before


@pytest.mark.gpu
def test_next_call_reports():
    """A bad value is reported by the next serving call on the device, without a sync."""
    B, H, K = 4, 2, 64
    q, k, g, v, beta, *_ = _tokens(B, H, K, K, "none", seed=60)
    pool = torch.zeros(8, H, K, K, device="cuda")
    kda_cute.clear_caches()  # (only this call's names noted)
    bad = torch.tensor([0, 1, 99, 3], dtype=torch.int32, device="cuda")
    kda_cute.decode(q, k, v, g, beta, pool, bad, gate="none")
    torch.cuda.synchronize()
    good = torch.tensor([0, 1, 2, 3], dtype=torch.int32, device="cuda")
    with pytest.raises(kda_cute.DeviceValueError,
                       match=re.escape("state_indices (decode's read slot): expected")):
        kda_cute.decode(q, k, v, g, beta, pool, good, gate="none")
    kda_cute.decode(q, k, v, g, beta, pool, good, gate="none")
    kda_cute.check_errors(sync=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_eager_loop_on_refilled_buffers(dtype, monkeypatch):
    """A serving loop's eager decodes on fixed buffers refilled in place each step (new
    tokens, new slots; the outputs poisoned first): after the first step each call repeats
    the first one's launch (launch.again), and every step is right; a step on another stream
    too; a bad slot written into the same index buffer is reported by the next call."""
    B, H, K, slots = 8, 4, 128, 32
    q, k, g, v, beta, A_log, dt_bias = (torch.empty_like(t) for t in
                                        _tokens(B, H, K, K, "bounded", seed=80))
    gen = torch.Generator(device="cuda").manual_seed(81)
    pool = (torch.randn(slots, H, K, K, generator=gen, device="cuda") * 0.3).to(dtype)
    idx = torch.empty(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, H, K, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    kda_cute.clear_caches()
    runs = []
    real_run = launch.run
    monkeypatch.setattr(launch, "run", lambda *a, **kw: runs.append(1) or real_run(*a, **kw))
    for step in range(4):
        for dst, src in zip((q, k, g, v, beta, A_log, dt_bias),
                            _tokens(B, H, K, K, "bounded", seed=82 + step), strict=True):
            dst.copy_(src)
        idx.copy_(torch.randperm(slots, generator=gen, device="cuda")[:B])
        out.fill_(float("nan"))
        before = pool.clone()
        kw = _kw("bounded", A_log, dt_bias)
        if step == 2:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                kda_cute.decode(q, k, v, g, beta, pool, idx, out=out, **kw)
            torch.cuda.current_stream().wait_stream(side)
        else:
            kda_cute.decode(q, k, v, g, beta, pool, idx, out=out, **kw)
        torch.cuda.synchronize()
        kda_cute.check_errors(sync=True)
        for n in range(B):
            o, st = _steps(q[n:n + 1], k[n:n + 1], g[n:n + 1], v[n:n + 1], beta[n:n + 1],
                           before[idx[n]], "bounded", A_log, dt_bias, -5.0, K ** -0.5)
            assert rel_err(out[n], o[0]) < OUT_TOL
            assert rel_err(pool[idx[n]], st[-1]) < STATE_TOL[dtype]
        rest = [s for s in range(slots) if s not in set(idx.tolist())]
        assert torch.equal(pool[rest], before[rest])
    assert len(runs) == 2  # step 0, and step 2 on the other stream
    idx[3] = slots + 5  # a bad slot, in the buffer the repeated launch reads
    kda_cute.decode(q, k, v, g, beta, pool, idx, out=out, **kw)
    torch.cuda.synchronize()
    idx[3] = 0
    with pytest.raises(kda_cute.DeviceValueError,
                       match="^" + re.escape("state_indices (decode's read slot): expected")):
        kda_cute.decode(q, k, v, g, beta, pool, idx, out=out, **kw)
    assert len(runs) == 2
    kda_cute.check_errors(sync=True)


@pytest.mark.gpu
def test_bound_decode_replays():
    B, H, K = 8, 4, 128
    q, k, g, v, beta, *_ = _tokens(B, H, K, K, "none", seed=70)
    pool = torch.randn(B, H, K, K, device="cuda") * 0.3
    ref_pool = pool.clone()
    idx = torch.arange(B, dtype=torch.int32, device="cuda")
    out = torch.empty(B, H, K, dtype=torch.bfloat16, device="cuda")
    bound = kda_cute.decode(q, k, v, g, beta, pool, idx, out=out, gate="none", bind=True)
    for _ in range(2):
        bound()
        ref_out = kda_cute.decode(q, k, v, g, beta, ref_pool, idx, gate="none")
        torch.cuda.synchronize()
        assert torch.equal(out, ref_out)
        assert torch.equal(pool, ref_pool)


def _tiles():
    from kda_cute.step_ladder import step_tiles
    return list(step_tiles())


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _tiles(), ids=lambda c: c.name)
def test_every_tile(cfg):
    """Each built token-step tile (shipped, wide, sweep variants): a decode and a 3-token verify
    (a chunked tile of 2: its refusal, then 2 tokens) against the float64 reference, through
    StepOptions.config."""
    K = cfg.head_dim_k
    dtype = torch.float32 if cfg.pool == "float32" else torch.bfloat16
    N, T, H = 6, 3, 3
    q, k, g, v, beta, A_log, dt_bias = _tokens(N * T, H, K, K, "unbounded", seed=80)
    pool = (torch.randn(4 * N * T, H, K, K, device="cuda") * 0.3).to(dtype)
    before = pool.clone()
    idx = torch.randperm(4 * N * T, device="cuda")[:N * T].view(N, T).to(torch.int32)
    kw = dict(A_log=A_log, dt_bias=dt_bias, gate="unbounded", config=cfg)
    d_idx = idx[:, 0].contiguous()
    out = kda_cute.decode(q[:N], k[:N], v[:N], g[:N], beta[:N], pool, d_idx, **kw)
    torch.cuda.synchronize()
    for n in range(N):
        o, st = _steps(q[n:n + 1], k[n:n + 1], g[n:n + 1], v[n:n + 1], beta[n:n + 1],
                       before[d_idx[n]], "unbounded", A_log, dt_bias, None, K ** -0.5)
        assert rel_err(out[n], o[0]) < OUT_TOL
        assert rel_err(pool[d_idx[n]], st[-1]) < STATE_TOL[dtype]
    pool.copy_(before)
    args = tuple(x.view(N, T, *x.shape[1:]) for x in (q, k, v, g, beta))
    if cfg.persist:  # a persistent tile runs single-token plans only (tests/test_persist.py)
        with pytest.raises(ValueError, match="config"):
            kda_cute.verify(*args, pool, ssm_state_indices=idx, **kw)
        return
    S = T
    if cfg.chunk and cfg.chunk < T:  # a chunked tile: rows of at most its chunk of tokens
        with pytest.raises(ValueError, match="config: a chunked tile"):
            kda_cute.verify(*args, pool, ssm_state_indices=idx, **kw)
        S = cfg.chunk
        args, idx = tuple(x[:, :S].contiguous() for x in args), idx[:, :S]
    out = kda_cute.verify(*args, pool, ssm_state_indices=idx, **kw)
    kda_cute.check_errors(sync=True)
    for n in range(N):
        rows = slice(n * T, n * T + S)
        o, states = _steps(q[rows], k[rows], g[rows], v[rows], beta[rows], before[idx[n, 0]],
                           "unbounded", A_log, dt_bias, None, K ** -0.5)
        assert rel_err(out[n], o) < OUT_TOL
        for t in range(S):
            assert rel_err(pool[idx[n, t]], states[t]) < STATE_TOL[dtype]
