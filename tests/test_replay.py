"""The replay calls (kda_cute.replay): decode, verify, commit and flush against a checkpoint pool
and its ring.

On a CPU: each call's checks (every bad input named), the ReplayProblem and plan it makes (the
ladder's tile for the mode, ring and pool; grids from shapes only; the ring's roles, the window).

On the GPU (marked gpu): against the float64 model kda_cute.replay_reference on the same
tokens, through folds, a verify, its commit and a flush; pools filled with a sentinel, slots
and ring entries the calls may not write checked bit-identical, padding rows' outputs zero; a
CUDA graph replayed with new indices; bad slots, cursors and counts reported."""

from __future__ import annotations

import inspect

import pytest
import torch

import kda_cute
from kda_cute import memo
from kda_cute import replay as rp
from kda_cute import replay_reference as ref
from kda_cute.checks import replay as replay_checks
from kda_cute.checks import step as step_checks
from kda_cute.plans.replay import replay_plan
from kda_cute.plans.steps import At, Role, Scalar
from kda_cute.reference import rel_err
from kda_cute.specs.replay import ReplayConfig
from kda_cute.step_ladder import HOIST, REPLAY, REPLAY_VARIANTS
from tests.mutations import must_refuse, odd_swaps, outcome, tensor_swaps

BF = torch.bfloat16
H, K = 4, 128


@pytest.fixture
def planned(monkeypatch):
    """The calls' plans, made on a CPU (the device check skipped): the last one is kept."""
    got = {}

    def fake(kind, c, dev):
        got["plan"] = replay_plan(c.problem, c.options)
        got["names"] = c.names
        return got["plan"]

    for m in (step_checks, replay_checks):
        monkeypatch.setattr(m, "on_cuda", lambda dev, what: None)
    monkeypatch.setattr(rp, "_plan", fake)
    def launch(plan, call, *a):
        # every tensor the plan names is one the call holds
        for step in plan.launches():
            for src in step.sources:
                if isinstance(src, Role):
                    assert getattr(call, src.name) is not None, src.name
        got["call"] = call

    monkeypatch.setattr(rp, "_launch", launch)
    monkeypatch.setattr(rp, "_again", lambda *a: False)
    memo.clear()
    yield got
    memo.clear()


def tok(*lead, d=K):
    return torch.randn(*lead, H, d).to(BF)


def pool_and_ring(slots=32, dtype=torch.float32, entries=16, u=torch.float16):
    state = torch.zeros(slots, H, K, K, dtype=dtype)
    return state, rp.new_ring(state, entries, u)


def decode_args(B=8, **kw):
    state, ring = pool_and_ring(**kw)
    return (tok(B, 1), tok(B, 1), tok(B, 1), tok(B, 1), torch.randn(B, 1, H).to(BF), state,
            ring, torch.arange(B, dtype=torch.int32))


def _decode(args, **kw):
    q, k, v, g, beta, state, ring, idx = args
    return kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx,
                                  lower_bound=-5.0, **kw)


def _verify(T=4, N=6, cu=None, **kw):
    state, ring = pool_and_ring(**{k: kw.pop(k) for k in ("dtype", "entries") if k in kw})
    lead = (1, int(cu[-1])) if cu is not None else (N, T)
    return kda_cute.replay_verify(tok(*lead), tok(*lead), tok(*lead), tok(*lead),
                                  torch.randn(*lead, H).to(BF), state, **ring,
                                  state_indices=torch.arange(N), cu_seqlens=cu,
                                  lower_bound=-5.0, **kw)


def test_new_ring_is_empty_and_a_mapping_of_the_calls_arguments():
    state, ring = pool_and_ring(slots=5, entries=8)
    assert set(ring) == {"ring_k", "ring_r", "ring_u", "ring_g", "cursor", "tickets"}
    assert ring["ring_k"].shape == (5, H, 8, K) and ring["ring_k"].dtype == BF
    assert ring["ring_u"].dtype == torch.float16 and ring["ring_r"].shape == (5, H, 8)
    assert ring.entries == 8 and int(ring.cursor.abs().sum()) == 0
    for bad, word in ((dict(entries=12), "entries"), (dict(u_dtype=BF), "u_dtype")):
        with pytest.raises(ValueError, match=word):
            rp.new_ring(state, **bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("entries", [8, 16, 32])
def test_decode_plan(planned, dtype, entries):
    _decode(decode_args(B=8, dtype=dtype, entries=entries), window=entries // 2)
    plan = planned["plan"]
    (s,) = plan.launches()
    cfg = s.kernel
    assert isinstance(cfg, ReplayConfig) and cfg in REPLAY and cfg.mode == "decode"
    assert (cfg.ring, cfg.pool) == (entries, str(dtype).replace("torch.", ""))
    assert s.grid == (K // cfg.block_v, H, 8)
    src = dict(zip(s.args, s.sources, strict=True))
    assert src["window"] == Scalar(entries // 2)
    assert all(src[n] == Role(n) for n in ("ring_k", "ring_r", "ring_u", "ring_g", "cursor",
                                             "tickets", "read_index", "pool", "dst"))
    assert "replay decode" in plan.describe()


def test_decode_window_defaults_to_the_ring(planned):
    _decode(decode_args(entries=8))
    src = dict(zip(planned["plan"].launches()[0].args, planned["plan"].launches()[0].sources,
                   strict=True))
    assert src["window"] == Scalar(8)


@pytest.mark.parametrize("T", [1, 4, 8, 9, 16])
def test_verify_plan(planned, T):
    _verify(T=T, N=6, entries=32)
    (s,) = planned["plan"].launches()
    assert s.kernel.mode == "verify" and s.grid == (K // s.kernel.block_v, H, 6)
    assert s.kernel.drafts == (8 if T <= 8 else 0) and s.kernel in REPLAY  # the fewest areas
    src = dict(zip(s.args, s.sources, strict=True))
    assert src["fixed_len"] == Scalar(T) and src["max_tokens"] == Scalar(T)
    assert src["write_mode"] == Scalar(0)


def test_verify_ragged_rows(planned):
    cu = torch.tensor([0, 3, 3, 10, 26, 27, 30], dtype=torch.int32)
    _verify(N=6, cu=cu, entries=32)
    src = dict(zip(planned["plan"].launches()[0].args, planned["plan"].launches()[0].sources,
                   strict=True))
    assert src["fixed_len"] == Scalar(-1) and src["max_tokens"] == Scalar(16)
    assert src["cu_seqlens"] == Role("cu_seqlens")


def test_commit_and_flush_plans(planned):
    state, ring = pool_and_ring(entries=16)
    idx = torch.tensor([3, -1, 5], dtype=torch.int64)
    kda_cute.replay_commit(**ring, state_indices=idx, num_accepted_tokens=torch.ones(3).int())
    (s,) = planned["plan"].launches()
    assert s.kernel.mode == "commit" and s.grid == (1, 1, 3)
    src = dict(zip(s.args, s.sources, strict=True))
    assert src["accepted"] == Role("accepted") and src["r_wide"] == Scalar(1)
    assert src["acc_wide"] == Scalar(0)
    # the cursors' length is the ring's slots (the kernel's bound on a slot); no state read
    assert dict(s.syms)["P"] == 32 and isinstance(src["pool"], At) and isinstance(src["dst"], At)
    kda_cute.replay_flush(state, **ring, state_indices=idx)
    (s,) = planned["plan"].launches()
    assert s.kernel.mode == "flush" and s.grid == (K // s.kernel.block_v, H, 3)


def test_error_words_are_named_for_the_replay_calls(planned):
    _decode(decode_args())
    assert dict(planned["names"])[3].startswith("state_indices")
    q, k, v, g, beta, state, ring, _ = decode_args()
    kda_cute.replay_decode(q, k, v, g, beta, state, **ring, lower_bound=-5.0)
    assert dict(planned["names"])[3] == "cursor"  # slot n for row n: only a cursor can be bad
    state, ring = pool_and_ring()
    kda_cute.replay_commit(**ring, state_indices=torch.arange(2),
                           num_accepted_tokens=torch.ones(2).int())
    assert dict(planned["names"])[2].startswith("num_accepted_tokens")
    _verify(T=2)
    assert "drafts" in dict(planned["names"])[1]


def _swap(ring, name, t):
    return {**dict(ring), name: t}


@pytest.mark.parametrize("case, word, exc", [
    ("ring entries 12", "ring_k", ValueError),
    ("ring_u bf16", "ring_u", TypeError),
    ("ring_g other slots", "ring_g", ValueError),
    ("ring_r strided", "ring_r", ValueError),
    ("cursor int64", "cursor", TypeError),
    ("tickets short", "tickets", ValueError),
    ("window 0", "window", ValueError),
    ("window past the ring", "window", ValueError),
    ("window bool", "window", ValueError),
    ("head dims 64", "q", ValueError),
    ("config of verify", "config", ValueError),
    ("config a StepConfig", "config", TypeError),
])
def test_decode_bad_metadata_named(planned, case, word, exc):
    args = list(decode_args(entries=16))
    q, k, v, g, beta, state, ring, idx = args
    kw = {}
    if case == "ring entries 12":
        ring = _swap(ring, "ring_k", torch.zeros(32, H, 12, K, dtype=BF))
    elif case == "ring_u bf16":
        ring = _swap(ring, "ring_u", ring["ring_u"].to(BF))
    elif case == "ring_g other slots":
        ring = _swap(ring, "ring_g", torch.zeros(31, H, 16, K))
    elif case == "ring_r strided":
        ring = _swap(ring, "ring_r", torch.zeros(32, H, 16, 2)[..., 0])
    elif case == "cursor int64":
        ring = _swap(ring, "cursor", ring["cursor"].long())
    elif case == "tickets short":
        ring = _swap(ring, "tickets", ring["tickets"][:-1])
    elif case == "window 0":
        kw["window"] = 0
    elif case == "window past the ring":
        kw["window"] = 17
    elif case == "window bool":
        kw["window"] = True
    elif case == "head dims 64":
        q, k, g = tok(8, 1, d=64), tok(8, 1, d=64), tok(8, 1, d=64)
        v = tok(8, 1, d=64)
        state = torch.zeros(32, H, 64, 64)
        ring = rp.new_ring(state, 16)
    elif case == "config of verify":
        kw["config"] = next(c for c in REPLAY if c.mode == "verify" and c.ring == 16)
    elif case == "config a StepConfig":
        kw["config"] = kda_cute.StepConfig(128, 128, "float32", 32, 32, 128)
    with pytest.raises(exc, match=word):
        kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx,
                               lower_bound=-5.0, **kw)


def test_verify_bad_metadata_named(planned):
    with pytest.raises(ValueError, match="q: expected at most 16 drafts"):
        _verify(T=17, entries=32)
    with pytest.raises(ValueError, match="q: expected at most 8 drafts a row for a ring of 8"):
        _verify(T=9, entries=8)
    with pytest.raises(TypeError, match="state_indices"):
        state, ring = pool_and_ring()
        kda_cute.replay_verify(tok(2, 2), tok(2, 2), tok(2, 2), tok(2, 2),
                               torch.randn(2, 2, H).to(BF), state, **ring,
                               state_indices=torch.arange(2).float(), lower_bound=-5.0)
    with pytest.raises(ValueError, match="state_indices"):
        state, ring = pool_and_ring()
        kda_cute.replay_verify(tok(2, 2), tok(2, 2), tok(2, 2), tok(2, 2),
                               torch.randn(2, 2, H).to(BF), state, **ring,
                               state_indices=torch.arange(3), lower_bound=-5.0)


def test_commit_and_flush_bad_metadata_named(planned):
    state, ring = pool_and_ring()
    with pytest.raises(ValueError, match="num_accepted_tokens"):
        kda_cute.replay_commit(**ring, state_indices=torch.arange(2),
                               num_accepted_tokens=torch.ones(3).int())
    with pytest.raises(TypeError, match="num_accepted_tokens"):
        kda_cute.replay_commit(**ring, state_indices=torch.arange(2),
                               num_accepted_tokens=torch.ones(2))
    with pytest.raises(ValueError, match="ring_k"):
        kda_cute.replay_flush(state[:5], **ring, state_indices=torch.arange(2))
    with pytest.raises(TypeError, match="state"):
        kda_cute.replay_flush(state.half(), **ring, state_indices=torch.arange(2))


def _fuzz_calls():
    """(function, the arguments passed by position, a valid call's arguments) of each call."""
    B, T = 3, 2
    state, ring = pool_and_ring(slots=8, entries=8)

    def toks(T_):
        return dict(q=tok(B, T_), k=tok(B, T_), v=tok(B, T_), g=tok(B, T_),
                    beta=torch.randn(B, T_, H).to(BF), out=tok(B, T_))

    gates = dict(A_log=torch.randn(H), dt_bias=torch.randn(H, K), lower_bound=-5.0)
    idx = torch.arange(B, dtype=torch.int32)
    tokens = ("q", "k", "v", "g", "beta", "state")
    return {
        "decode": (kda_cute.replay_decode, tokens, dict(
            **toks(1), state=state, **ring, state_indices=idx, window=4, **gates)),
        "verify": (kda_cute.replay_verify, tokens, dict(
            **toks(T), state=state, **ring, state_indices=idx, **gates)),
        "commit": (kda_cute.replay_commit, (), dict(
            **ring, state_indices=idx, num_accepted_tokens=torch.ones(B, dtype=torch.int32))),
        "flush": (kda_cute.replay_flush, ("state",), dict(state=state, **ring,
                                                         state_indices=idx)),
    }


@pytest.mark.parametrize("entry", ["decode", "verify", "commit", "flush"])
def test_every_tensor_argument_mutated(entry, planned):
    """Each tensor argument of a valid call replaced by each of tests/mutations.py's values:
    the call goes through or raises TypeError / ValueError naming the call's own arguments."""
    fn, positional, kw = _fuzz_calls()[entry]
    names = set(inspect.signature(fn).parameters)
    assert outcome(fn, kw, names, positional) is None
    refused = 0
    for arg, what, bad in tensor_swaps(kw):
        if outcome(fn, bad, names, positional, (arg, what)) is not None:
            refused += 1
        else:
            assert not must_refuse(arg, what), f"{entry}: {arg} ({what}) accepted"
            # a ring tensor other than a valid one refused (a commit reads the cursors alone)
            assert entry == "commit" or not arg.startswith("ring_") or (arg, what) == (
                "ring_u", "dtype torch.float32"), (arg, what)
    assert refused > 20


@pytest.mark.parametrize("entry", ["decode", "verify", "commit", "flush"])
def test_every_argument_given_odd_values(entry, planned):
    fn, positional, kw = _fuzz_calls()[entry]
    names = set(inspect.signature(fn).parameters)
    for arg, odd, bad in odd_swaps(fn, kw, positional):
        outcome(fn, bad, names, positional, (arg, odd))


def test_on_cpu_the_device_is_named():
    memo.clear()
    with pytest.raises(ValueError, match="a CUDA tensor"):
        _decode(decode_args())


def test_every_call_is_a_torch_op():
    for fn in (kda_cute.replay_decode, kda_cute.replay_verify, kda_cute.replay_commit,
               kda_cute.replay_flush):
        assert all(hasattr(torch.ops.kda_cute, n) for n in fn.ops)


# ------------------------------------------------------------------------------- on the GPU
OUT_TOL = 3.5e-3  # bf16 output rounding alone is ~1.7e-3
STATE_TOL = {torch.float32: 1e-3, torch.bfloat16: 6e-3}


def _gen(seed):
    return torch.Generator(device="cuda").manual_seed(seed)


def _toks(N, T, gen):
    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(BF)
    return rnd(N, T, H, K), rnd(N, T, H, K), rnd(N, T, H, K), rnd(N, T, H, K), rnd(N, T, H)


def _gate(gen):
    return dict(A_log=torch.randn(H, generator=gen, device="cuda") * 0.5,
                dt_bias=torch.randn(H * K, generator=gen, device="cuda") * 0.5,
                lower_bound=-5.0)


def _model(state, ring: rp.Ring):
    """The float64 model's pool and ring from the device's (cpu, float64)."""
    return state.double().cpu(), ref.Ring(ring.ring_k.double().cpu(), ring.ring_r.double().cpu(),
                                          ring.ring_u.double().cpu(), ring.ring_g.double().cpu(),
                                          ring.cursor.long().cpu())


def _ref_gate(gate):
    return dict(A_log=gate["A_log"].cpu(), dt_bias=gate["dt_bias"].cpu(),
                lower_bound=gate["lower_bound"])


def _cpu(*ts):
    return [t.cpu() for t in ts]


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("wide", [False, True], ids=["i32", "i64"])
def test_decode_verify_commit_flush_against_float64(dtype, wide):
    """Decode steps through folds (window 4 of 16 entries), a verify of ragged drafts, their
    commit, more decode steps and a flush, each against the float64 model on the same
    tokens; padding rows, untouched slots and untouched ring entries checked."""
    N, slots, L, W = 10, 40, 16, 4
    gen = _gen(7 + wide)
    state = (torch.randn(slots, H, K, K, generator=gen, device="cuda") * 0.3).to(dtype)
    ring = rp.new_ring(state, L)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:N]
    idx[[2, 7]] = -1
    idx = idx.to(torch.int64 if wide else torch.int32)
    gate = _gate(gen)
    m_state, m_ring = _model(state, ring)
    live = idx[idx >= 0].long()
    others = torch.ones(slots, dtype=torch.bool, device="cuda")
    others[live] = False
    before_others = _bits(state[others]).clone()
    for t in range(6):  # folds at the 4th token of each window
        q, k, v, g, beta = _toks(N, 1, gen)
        out = torch.full((N, 1, H, K), float("nan"), dtype=BF, device="cuda")
        kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx, out=out,
                               window=W, **gate)
        o = ref.decode(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), window=W,
                       **_ref_gate(gate))
        kda_cute.check_errors(sync=True)
        assert rel_err(out[idx >= 0], o[(idx >= 0).cpu()].cuda()) < OUT_TOL, t
        assert (out[idx < 0] == 0).all()
        assert torch.equal(ring.cursor[live].cpu(), m_ring.cursor[live.cpu()].int())
    assert rel_err(state[live], m_state[live.cpu()].cuda()) < STATE_TOL[dtype]
    # ragged drafts: rows of 0 to 5 tokens, packed
    lens = torch.tensor([3, 5, 2, 1, 0, 4, 2, 3, 5, 1])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).cuda().int()
    Tn = int(lens.sum())
    q, k, v, g, beta = _toks(1, Tn, gen)
    out = torch.full((1, Tn, H, K), float("nan"), dtype=BF, device="cuda")
    state_before, cursor_before = _bits(state).clone(), ring.cursor.clone()
    kda_cute.replay_verify(q, k, v, g, beta, state, **ring, state_indices=idx, cu_seqlens=cu,
                           out=out, **gate)
    kda_cute.check_errors(sync=True)
    assert torch.equal(_bits(state), state_before) and torch.equal(ring.cursor, cursor_before)
    for n in range(N):
        rows = slice(int(cu[n]), int(cu[n + 1]))
        if lens[n] == 0:
            continue
        if idx[n] < 0:
            assert (out[0, rows] == 0).all()
            continue
        o = ref.verify(m_state, m_ring, idx[n:n + 1].cpu(),
                       *(x[:, rows].cpu() for x in (q, k, v, g, beta)), **_ref_gate(gate))
        assert rel_err(out[0, rows], o[0].cuda()) < OUT_TOL, n
    acc = torch.clamp(lens, max=3).to(torch.int32).cuda()
    kda_cute.replay_commit(**ring, state_indices=idx, num_accepted_tokens=acc)
    ref.commit(m_ring, idx.cpu(), acc.cpu())
    kda_cute.check_errors(sync=True)
    assert torch.equal(ring.cursor[live].cpu(), m_ring.cursor[live.cpu()].int())
    for t in range(3):
        q, k, v, g, beta = _toks(N, 1, gen)
        out = torch.empty(N, 1, H, K, dtype=BF, device="cuda")
        kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx, out=out,
                               window=W, **gate)
        o = ref.decode(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), window=W,
                       **_ref_gate(gate))
        assert rel_err(out[idx >= 0], o[(idx >= 0).cpu()].cuda()) < OUT_TOL, t
    kda_cute.replay_flush(state, **ring, state_indices=idx)
    ref.flush(m_state, m_ring, idx.cpu())
    kda_cute.check_errors(sync=True)
    assert rel_err(state[live], m_state[live.cpu()].cuda()) < STATE_TOL[dtype]
    assert (ring.cursor[live] == 0).all() and (ring.tickets == 0).all()
    assert torch.equal(_bits(state[others]), before_others)


@pytest.mark.gpu
def test_graph_replays_with_new_indices_and_cursors():
    N, slots, L = 8, 24, 8
    gen = _gen(3)
    state = torch.randn(slots, H, K, K, generator=gen, device="cuda") * 0.3
    ring = rp.new_ring(state, L)
    gate = _gate(gen)
    q, k, v, g, beta = _toks(N, 1, gen)
    idx = torch.arange(N, dtype=torch.int32, device="cuda")
    out = torch.empty(N, 1, H, K, dtype=BF, device="cuda")

    def step():
        kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx, out=out,
                               **gate)
    step()  # planned and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    m_state, m_ring = _model(state, ring)
    for rnd in range(3):
        idx.copy_(torch.randperm(slots, generator=gen, device="cuda")[:N].int())
        for x, y in zip((q, k, v, g, beta), _toks(N, 1, gen), strict=True):
            x.copy_(y)
        graph.replay()
        o = ref.decode(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), window=L,
                       **_ref_gate(gate))
        torch.cuda.synchronize()
        assert rel_err(out, o.cuda()) < OUT_TOL, rnd
        assert torch.equal(ring.cursor.cpu(), m_ring.cursor.int())


@pytest.mark.gpu
def test_graph_of_verify_and_commit_replays_with_new_cursors_and_counts():
    """replay_verify then replay_commit captured once, replayed with new slots, cursors and
    counts in the same buffers: outputs and cursors as the float64 model's each time."""
    N, slots, L, T = 6, 20, 16, 4
    gen = _gen(13)
    state = torch.randn(slots, H, K, K, generator=gen, device="cuda") * 0.3
    ring = rp.new_ring(state, L)
    for _ in range(3):  # live entries to verify past
        kda_cute.replay_decode(*_toks(slots, 1, gen), state, **ring, window=L, **_gate(gen))
    gate = _gate(gen)
    q, k, v, g, beta = _toks(N, T, gen)
    idx = torch.arange(N, dtype=torch.int32, device="cuda")
    acc = torch.ones(N, dtype=torch.int32, device="cuda")
    out = torch.empty(N, T, H, K, dtype=BF, device="cuda")

    def step():
        kda_cute.replay_verify(q, k, v, g, beta, state, **ring, state_indices=idx, out=out,
                               **gate)
        kda_cute.replay_commit(**ring, state_indices=idx, num_accepted_tokens=acc)
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for rnd in range(3):
        idx.copy_(torch.randperm(slots, generator=gen, device="cuda")[:N].int())
        ring.cursor.copy_(torch.randint(0, 8, (slots,), generator=gen, device="cuda").int())
        acc.copy_(torch.randint(0, T + 1, (N,), generator=gen, device="cuda").int())
        for x, y in zip((q, k, v, g, beta), _toks(N, T, gen), strict=True):
            x.copy_(y)
        m_state, m_ring = _model(state, ring)
        graph.replay()
        o = ref.verify(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), **_ref_gate(gate))
        ref.commit(m_ring, idx.cpu(), acc.cpu())
        kda_cute.check_errors(sync=True)
        assert rel_err(out, o.cuda()) < OUT_TOL, rnd
        assert torch.equal(ring.cursor.cpu(), m_ring.cursor.int()), rnd


@pytest.mark.gpu
def test_bad_values_reported_and_contained():
    N, slots, L = 4, 8, 8
    gen = _gen(5)
    state = torch.randn(slots, H, K, K, generator=gen, device="cuda")
    ring = rp.new_ring(state, L)
    gate = _gate(gen)
    q, k, v, g, beta = _toks(N, 1, gen)
    before = state.clone()
    idx = torch.tensor([0, 99, 2, 3], dtype=torch.int32, device="cuda")  # a slot past the pool
    out = torch.full((N, 1, H, K), float("nan"), dtype=BF, device="cuda")
    kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx, out=out, **gate)
    with pytest.raises(kda_cute.DeviceValueError, match="state_indices"):
        kda_cute.check_errors(sync=True)
    assert (out[1] == 0).all() and torch.equal(state, before)
    ring.cursor[2] = L  # a cursor past the ring
    idx[1] = 1
    kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx, out=out, **gate)
    with pytest.raises(kda_cute.DeviceValueError, match="cursor"):
        kda_cute.check_errors(sync=True)
    assert (out[2] == 0).all() and int(ring.cursor[2]) == L
    ring.cursor.fill_(3)
    kda_cute.replay_commit(**ring, state_indices=idx,
                           num_accepted_tokens=torch.tensor([1, L, -1, 0], device="cuda").int())
    with pytest.raises(kda_cute.DeviceValueError, match="num_accepted_tokens"):
        kda_cute.check_errors(sync=True)
    assert ring.cursor[:4].tolist() == [4, 3, 3, 3]
    q2, k2, v2, g2, beta2 = _toks(N, 6, gen)
    ring.cursor.fill_(L - 3)  # six drafts past a ring of 8 at cursor 5
    out2 = torch.full((N, 6, H, K), float("nan"), dtype=BF, device="cuda")
    kda_cute.replay_verify(q2, k2, v2, g2, beta2, state, **ring, state_indices=idx, out=out2,
                           **gate)
    with pytest.raises(kda_cute.DeviceValueError, match="drafts"):
        kda_cute.check_errors(sync=True)
    assert (out2 == 0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_prefill_takes_a_flushed_slot(dtype):
    """The prefill's pool form on replay slots: decode steps fill the rings, a flush folds them,
    kda_cute.fwd continues each sequence from its checkpoint and writes it back, and the next
    replay decode steps start from that checkpoint and an empty ring; all against the float64
    model (the prefill's tokens run through it a token at a time, folding each)."""
    N, slots, L, T = 4, 12, 8, 64
    gen = _gen(11)
    state = (torch.randn(slots, H, K, K, generator=gen, device="cuda") * 0.3).to(dtype)
    ring = rp.new_ring(state, L)
    idx = torch.tensor([5, 0, 9, 3], dtype=torch.int32, device="cuda")
    gate = _gate(gen)
    m_state, m_ring = _model(state, ring)
    for _ in range(3):
        q, k, v, g, beta = _toks(N, 1, gen)
        kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx, **gate)
        ref.decode(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), window=L,
                   **_ref_gate(gate))
    kda_cute.replay_flush(state, **ring, state_indices=idx)
    ref.flush(m_state, m_ring, idx.cpu())
    q, k, v, g, beta = _toks(1, N * T, gen)
    out = torch.empty_like(v)
    cu = torch.arange(0, N * T + 1, T, dtype=torch.int32, device="cuda")
    kda_cute.fwd(q, k, v, g, beta, K ** -0.5, out, gate["A_log"], gate["dt_bias"], -5.0,
                 state, state, cu, state_indices=idx)
    for n in range(N):  # the model: the sequence's tokens one a step, each folded
        rows = slice(n * T, (n + 1) * T)
        outs = [ref.decode(m_state, m_ring, idx[n:n + 1].cpu(),
                           *(x[:, rows][:, t:t + 1].cpu() for x in (q, k, v, g, beta)),
                           window=1, **_ref_gate(gate)) for t in range(T)]
        assert rel_err(out[:, rows], torch.cat(outs, 1).cuda()) < OUT_TOL, n
    kda_cute.check_errors(sync=True)
    assert rel_err(state[idx.long()], m_state[idx.long().cpu()].cuda()) < STATE_TOL[dtype]
    assert (ring.cursor[idx.long()] == 0).all()
    for _ in range(2):
        q, k, v, g, beta = _toks(N, 1, gen)
        o = kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx, **gate)
        m = ref.decode(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), window=L,
                       **_ref_gate(gate))
        assert rel_err(o, m.cuda()) < OUT_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("T", [5, 11])
def test_verify_drafts_against_float64(dtype, T):
    """A verify of T drafts a row ([N, T]) from cursors spread over a ring of 16 holding
    earlier entries: outputs against the float64 model, the drafts' entries written at
    c .. c + T - 1 (keys as given, G, u), every other entry, the checkpoints and the cursors
    bit-identical."""
    N, slots, L = 6, 16, 16
    gen = _gen(T)
    state = (torch.randn(slots, H, K, K, generator=gen, device="cuda") * 0.3).to(dtype)
    ring = rp.new_ring(state, L)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:N].int()
    idx[4] = -1
    gate = _gate(gen)
    for _ in range(5):  # earlier entries: five decode steps, no fold
        kda_cute.replay_decode(*_toks(N, 1, gen), state, **ring, state_indices=idx, window=L,
                               **gate)
    ring.cursor[idx[idx >= 0].long()] = torch.tensor([0, 1, 3, 5, 2], dtype=torch.int32,
                                                     device="cuda")[:N - 1] % (L - T + 1)
    m_state, m_ring = _model(state, ring)
    before = {n: _bits(getattr(ring, n)).clone() for n in ("ring_k", "ring_r", "ring_u",
                                                          "ring_g", "cursor")}
    state_before = _bits(state).clone()
    q, k, v, g, beta = _toks(N, T, gen)
    out = torch.full((N, T, H, K), float("nan"), dtype=BF, device="cuda")
    kda_cute.replay_verify(q, k, v, g, beta, state, **ring, state_indices=idx, out=out, **gate)
    o = ref.verify(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), **_ref_gate(gate))
    kda_cute.check_errors(sync=True)
    live = (idx >= 0)
    assert rel_err(out[live], o[live.cpu()].cuda()) < OUT_TOL
    assert (out[~live] == 0).all()
    assert torch.equal(_bits(state), state_before)
    assert torch.equal(_bits(ring.cursor), before["cursor"])
    written = torch.zeros(slots, L, dtype=torch.bool)
    for n in range(N):
        s = int(idx[n])
        if s >= 0:
            c = int(ring.cursor[s])
            written[s, c:c + T] = True
    w = written.cuda()
    for name in ("ring_k", "ring_r", "ring_u", "ring_g"):
        now = _bits(getattr(ring, name))
        keep = ~w.view(slots, 1, L).expand(slots, H, L)
        assert torch.equal(now[keep], before[name][keep]), name
    for name, tol in (("ring_g", 1e-4), ("ring_u", 2e-3)):
        got = getattr(ring, name).double().cpu()
        want = getattr(m_ring, name.removeprefix("ring_"))
        sel = written.view(slots, 1, L).expand(slots, H, L)
        assert rel_err(got[sel], want[sel]) < tol, name
    assert torch.equal(ring.ring_k.double().cpu()[written.view(slots, 1, L).expand(slots, H, L)],
                       m_ring.k[written.view(slots, 1, L).expand(slots, H, L)])


_TILES = [c for c in REPLAY + REPLAY_VARIANTS if c.mode in ("decode", "verify")]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", _TILES, ids=lambda c: c.name.removeprefix("kda_replay_"))
def test_every_tile(cfg):
    """Each built decode and verify tile, shipped or for the sweep, through config=: decode
    steps over a window of HOIST + 2 (at most the ring), the last a fold of entries both held
    in registers and read from shared memory, or a verify of as many drafts as the tile holds
    (at most 6) past cursor 2, against the float64 model."""
    gen, state, ring, idx, gate, m_state, m_ring = _tile_inputs(cfg, cfg.ring + cfg.block_v, 3)
    N, live = idx.shape[0], idx >= 0
    if cfg.mode == "decode":
        window = min(cfg.ring, HOIST + 2)
        for _ in range(window):
            q, k, v, g, beta = _toks(N, 1, gen)
            out = kda_cute.replay_decode(q, k, v, g, beta, state, **ring, state_indices=idx,
                                         window=window, config=cfg, **gate)
            o = ref.decode(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), window=window,
                           **_ref_gate(gate))
            kda_cute.check_errors(sync=True)
            assert rel_err(out[live], o[live.cpu()].cuda()) < OUT_TOL
        assert rel_err(state[idx[live].long()], m_state[idx[live].long().cpu()].cuda()) < \
            STATE_TOL[state.dtype]
        return
    _verify_tile(cfg, min(6, cfg.drafts or min(cfg.ring, 16), cfg.ring - 2), gen, state, ring,
                 idx, gate, m_state, m_ring)


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [c for c in _TILES if c.mma],
                         ids=lambda c: c.name.removeprefix("kda_replay_"))
def test_mma_tiles_with_every_draft(cfg):
    """The verify tiles whose checkpoint products run on mma.sync, with as many drafts as the
    tile holds (every n tile of the products) past cursor 2, against the float64 model."""
    gen, state, ring, idx, gate, m_state, m_ring = _tile_inputs(cfg, cfg.ring + cfg.block_v + 1,
                                                                1)
    _verify_tile(cfg, min(cfg.drafts or min(cfg.ring, 16), cfg.ring - 2), gen, state, ring,
                 idx, gate, m_state, m_ring)


def _tile_inputs(cfg, seed, pad):
    """A tile test's inputs: 5 rows over 12 slots of random states (row `pad` padding), a new
    ring of cfg's, the gate, and the float64 model's copies."""
    N, slots = 5, 12
    dtype = torch.float32 if cfg.pool == "float32" else torch.bfloat16
    gen = _gen(seed)
    state = (torch.randn(slots, H, K, K, generator=gen, device="cuda") * 0.3).to(dtype)
    ring = rp.new_ring(state, cfg.ring, torch.float16 if cfg.u_dtype == "float16" else
                       torch.float32)
    idx = torch.randperm(slots, generator=gen, device="cuda")[:N].int()
    idx[pad] = -1
    gate = _gate(gen)
    return (gen, state, ring, idx, gate, *_model(state, ring))


def _verify_tile(cfg, T, gen, state, ring, idx, gate, m_state, m_ring):
    """A verify of T drafts past cursor 2 through config=cfg against the float64 model."""
    N = idx.shape[0]
    live = idx >= 0
    ring.cursor.fill_(2)
    m_ring.cursor.fill_(2)
    q, k, v, g, beta = _toks(N, T, gen)
    out = kda_cute.replay_verify(q, k, v, g, beta, state, **ring, state_indices=idx,
                                 config=cfg, **gate)
    o = ref.verify(m_state, m_ring, idx.cpu(), *_cpu(q, k, v, g, beta), **_ref_gate(gate))
    kda_cute.check_errors(sync=True)
    assert rel_err(out[live], o[live.cpu()].cuda()) < OUT_TOL
    assert (out[~live] == 0).all()
