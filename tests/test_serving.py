"""The serving calls on a CPU: their argument checks (each bad input named), the StepProblem and
plan each call makes (grids from shapes only, the sources of absent tables, the single-token
shared-memory trim), and fla's call's refusals. The kernels run in tests/test_gpu_serving.py."""

import inspect

import pytest
import torch

import kda_cute
from kda_cute import serving
from kda_cute.ladder import STEP, select_step
from kda_cute.plans.step import step_plan
from kda_cute.plans.steps import At, Errors, Role
from kda_cute.specs.step import WRITE_ALL, WRITE_LAST, WRITE_START, StepConfig, supports
from tests.mutations import ODD, must_refuse, odd_swaps, outcome, tensor_swaps

BF = torch.bfloat16
H, K = 4, 128


@pytest.fixture
def planned(monkeypatch):
    """The calls' plans, made on a CPU (the device check skipped): the last one is kept."""
    got = {}

    def fake(p, opts, dev, what="q", dry=False):
        serving._config(p, opts)
        got["plan"] = step_plan(p, opts)
        return got["plan"]

    monkeypatch.setattr(serving, "_planned", fake)
    monkeypatch.setattr(serving, "_launch", lambda *a: None)
    monkeypatch.setattr(serving, "_again", lambda *a: False)
    serving.clear()
    yield got
    serving.clear()


def tok(*lead, d=K):
    return torch.randn(*lead, H, d).to(BF)


def decode_args(B=8, slots=32, dtype=torch.float32):
    return (tok(B, 1), tok(B, 1), tok(B, 1), tok(B, 1), torch.randn(B, 1, H).to(BF),
            torch.zeros(slots, H, K, K, dtype=dtype), torch.arange(B, dtype=torch.int32))


def test_single_token_tiles_by_width():
    """STEP_SINGLE: from each threshold of rows x heads on, its tile; below all, STEP's."""
    from kda_cute.ladder import STEP_SINGLE
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
    from kda_cute.ladder import STEP_SINGLE
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
    from kda_cute.ladder import STEP_MULTI
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
    from kda_cute.ladder import STEP_CHUNK, STEP_MULTI, STEP_SINGLE, select_chunk
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
    serving.clear()
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
    from kda_cute.ladder import step_tiles
    from kda_cute.specs.step import args as step_args
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
