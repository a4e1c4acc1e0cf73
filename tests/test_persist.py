"""GPU tests of the persistent token-step tiles (StepConfig.persist: a CTA walks many tiles and
stages the next one while it computes) against a float64 reference, with enough tiles that every
CTA runs several: decode in place and to other slots, padding rows, rows that start from zeros,
a bad slot, a single-token verify, a CUDA graph replayed with new slots, and the refusal of
multi-token plans."""

import pytest
import torch

import kda_cute
from kda_cute.reference import preprocess, rel_err
from kda_cute.testing import GUARD, SENTINEL
from kda_cute.testing import bits as _bits
from kda_cute.testing import guarded as _guarded
from kda_cute.testing import guards_ok as _guards_ok

pytestmark = pytest.mark.gpu

OUT_TOL = 3.5e-3
STATE_TOL = {torch.float32: 1e-5, torch.bfloat16: 6e-3}
N, H = 300, 4


def _persistent():
    from kda_cute.step_ladder import step_tiles
    return [c for c in step_tiles() if c.persist]


def _inputs(K, gate, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(torch.bfloat16)

    q, k, g, v, beta = rnd(N, 1, H, K), rnd(N, 1, H, K), rnd(N, 1, H, K), rnd(N, 1, H, K), \
        rnd(N, 1, H)
    A_log = torch.randn(H, generator=gen, device="cuda") * 0.5
    dt_bias = torch.randn(H * K, generator=gen, device="cuda") * 0.5
    return q, k, g, v, beta, A_log, dt_bias


def _reference(q, k, g, v, beta, S0, gate, A_log, dt_bias, lb):
    """float64, one token for every row at once: outputs [N, H, V], states [N, H, V, K]."""
    K = q.shape[-1]
    qn, kn, a, b = preprocess(q, k, g, beta, A_log=A_log, dt_bias=dt_bias, lower_bound=lb,
                              gate=gate)
    qn, kn, a, b = qn[:, 0], kn[:, 0], a[:, 0], b[:, 0]
    S = S0.double() * torch.exp(a)[:, :, None, :]
    e = v[:, 0].double() - (S @ kn[..., None])[..., 0]
    S = S + b[..., None, None] * e[..., None] * kn[:, :, None, :]
    return K ** -0.5 * (S @ qn[..., None])[..., 0], S


@pytest.mark.parametrize("cfg", _persistent(), ids=lambda c: c.name)
@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
def test_persistent_decode(cfg, gate):
    K = cfg.head_dim_k
    dtype = torch.float32 if cfg.pool == "float32" else torch.bfloat16
    tiles = K // cfg.block_v * H * N
    assert tiles > 132 * cfg.persist, "every CTA should run several tiles"
    q, k, g, v, beta, A_log, dt_bias = _inputs(K, gate, seed=7)
    slots = 4 * N + 8
    pool, buf = _guarded((slots, H, K, K), dtype, pad=8)
    gen = torch.Generator(device="cuda").manual_seed(11)
    perm = torch.randperm(slots, generator=gen, device="cuda")
    ri, wi = perm[:N].clone(), perm[N:2 * N].clone()
    for n in range(N):  # fresh random start states in the slots read
        pool[ri[n]] = (torch.randn(H, K, K, generator=gen, device="cuda") * 0.3).to(dtype)
    ri[5], ri[77], ri[299] = -1, -1, -1  # padding rows
    wi[5], wi[77], wi[299] = -1, -1, -1
    init = torch.ones(N, dtype=torch.bool, device="cuda")
    init[10], init[200] = False, False  # rows that start from zeros
    before = pool.clone()
    lb = -5.0 if gate == "bounded" else None
    kw = dict(A_log=A_log, dt_bias=dt_bias, gate=gate, lower_bound=lb, config=cfg)
    out = torch.full_like(v, 7.0)
    kda_cute.decode(q, k, v, g, beta, pool, ri, output_state_indices=wi,
                    has_initial_state=init, out=out, **kw)
    kda_cute.check_errors(sync=True)
    S0 = before[ri.clamp(min=0).long()].clone()
    S0[~init] = 0
    o_ref, s_ref = _reference(q, k, g, v, beta, S0, gate, A_log, dt_bias, lb)
    live = ri >= 0
    assert rel_err(out[live, 0], o_ref[live]) < OUT_TOL
    assert (out[~live] == 0).all()
    assert rel_err(pool[wi[live].long()], s_ref[live]) < STATE_TOL[dtype]
    untouched = torch.ones(slots, dtype=torch.bool, device="cuda")
    untouched[wi[live].long()] = False
    assert torch.equal(_bits(pool[untouched]), _bits(before[untouched]))
    assert _guards_ok(buf)
    gaps = buf[GUARD:-GUARD].view(slots, -1)[:, H * K * K:]
    assert (gaps == torch.tensor(SENTINEL, dtype=dtype)).all()


def _pair():
    """The shipped persistent tile and a register-capped one (not a chunked tile: those take
    multi-token rows, tests/test_serving.py)."""
    tiles = [c for c in _persistent() if not c.chunk]
    return tiles[:1] + tiles[-2:-1]


@pytest.mark.parametrize("cfg", _pair(), ids=lambda c: c.name)
def test_persistent_in_place_bad_slot_verify_graph(cfg):
    K = cfg.head_dim_k
    dtype = torch.float32 if cfg.pool == "float32" else torch.bfloat16
    q, k, g, v, beta, A_log, dt_bias = _inputs(K, "bounded", seed=9)
    slots = 2 * N
    pool = (torch.randn(slots, H, K, K, device="cuda") * 0.3).to(dtype)
    before = pool.clone()
    idx = torch.randperm(slots, device="cuda")[:N].to(torch.int32)
    kw = dict(A_log=A_log, dt_bias=dt_bias, lower_bound=-5.0, config=cfg)
    # in place, against a single-token verify of the same rows (the same kernel, other tables)
    out = kda_cute.decode(q, k, v, g, beta, pool, idx, **kw)
    after = pool.clone()
    pool.copy_(before)
    acc = torch.ones(N, dtype=torch.int32, device="cuda")
    out2 = kda_cute.verify(q, k, v, g, beta, pool, ssm_state_indices=idx[:, None].contiguous(),
                           num_accepted_tokens=acc, **kw)
    assert torch.equal(out2, out) and torch.equal(_bits(pool), _bits(after))
    o_ref, s_ref = _reference(q, k, g, v, beta, before[idx.long()], "bounded", A_log, dt_bias,
                              -5.0)
    assert rel_err(out[:, 0], o_ref) < OUT_TOL
    assert rel_err(after[idx.long()], s_ref) < STATE_TOL[dtype]
    # a bad slot: the row is padding, nothing outside the pool is touched, the next call raises
    pool.copy_(before)
    bad = idx.clone()
    bad[123] = slots + 5
    o = kda_cute.decode(q, k, v, g, beta, pool, bad, **kw)
    torch.cuda.synchronize()
    assert (o[123] == 0).all()
    with pytest.raises(kda_cute.DeviceValueError, match="state_indices"):
        kda_cute.check_errors(sync=True)
    # a CUDA graph captured once, replayed with new slots, equals eager calls
    pool.copy_(before)
    sl = idx.clone()
    gout = torch.empty_like(v)
    kda_cute.decode(q, k, v, g, beta, pool, sl, out=gout, **kw)  # warm (plans, memo)
    pool.copy_(before)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        kda_cute.decode(q, k, v, g, beta, pool, sl, out=gout, **kw)
    torch.cuda.current_stream().wait_stream(s)
    pool.copy_(before)
    sl.copy_(torch.randperm(slots, device="cuda")[:N].to(torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    got, got_pool = gout.clone(), pool.clone()
    pool.copy_(before)
    ref = kda_cute.decode(q, k, v, g, beta, pool, sl, **kw)
    assert torch.equal(got, ref) and torch.equal(_bits(got_pool), _bits(pool))
    # multi-token plans refuse a persistent tile
    q3 = q.view(N // 3, 3, H, K)
    with pytest.raises(ValueError, match="config"):
        kda_cute.verify(q3, q3, v.view(N // 3, 3, H, K), q3, beta.view(N // 3, 3, H), pool,
                        ssm_state_indices=idx.view(N // 3, 3), **kw)
