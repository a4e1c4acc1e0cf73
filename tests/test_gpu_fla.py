"""fla's own entry points dispatching to kda-cute on the H200 (fla-core >= 0.6 present; skips
otherwise): fla.ops.kda.chunk_kda as fla's KimiDeltaAttention calls it, and the decode entry
fused_recurrent_kda_fwd against a pool, each against the float64 reference."""

import pytest
import torch

from kda_cute.reference import rel_err
from kda_cute.testing import make_inputs, reference

pytestmark = pytest.mark.gpu
fla_kda = pytest.importorskip("fla.ops.kda")

from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd  # noqa: E402

from kda_cute import api, serving  # noqa: E402
from kda_cute.integrations import fla as kda_fla  # noqa: E402

OUT_TOL, STATE_TOL = 3.5e-3, 2.5e-3


@pytest.fixture
def calls(monkeypatch):
    """kda-cute's entries, counted as fla reaches them."""
    kda_fla.register()
    seen = {"chunk_kda": 0, "fused_recurrent_kda_fwd": 0}
    real_chunk, real_step = api.chunk_kda, serving.fused_recurrent_kda_fwd

    def chunk(*a, **kw):
        seen["chunk_kda"] += 1
        return real_chunk(*a, **kw)

    def step(*a, **kw):
        seen["fused_recurrent_kda_fwd"] += 1
        return real_step(*a, **kw)

    monkeypatch.setattr(api, "chunk_kda", chunk)
    monkeypatch.setattr(serving, "fused_recurrent_kda_fwd", step)
    return seen


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("v_first, cu_dtype", [(True, torch.int32), (False, torch.int64)])
@torch.no_grad()
def test_fla_chunk_kda_dispatches_here(calls, K, v_first, cu_dtype):
    inp = make_inputs(seqlens=[300, 77, 1024], H=4, K=K, seed=K)
    s0 = inp["initial_state"] if v_first else inp["initial_state"].transpose(-1, -2).contiguous()
    o, s = fla_kda.chunk_kda(
        q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"],
        A_log=inp["A_log"], dt_bias=inp["dt_bias"].flatten(), initial_state=s0,
        output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=False, safe_gate=True,
        lower_bound=-5.0, state_v_first=v_first, cu_seqlens=inp["cu_seqlens"].to(cu_dtype))
    assert calls["chunk_kda"] == 1
    ref_o, ref_s = reference(inp)
    if not v_first:
        s = s.transpose(-1, -2)
    assert rel_err(o, ref_o) < OUT_TOL and rel_err(s, ref_s) < STATE_TOL


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_fla_decode_entry_dispatches_here(calls, pool_dtype):
    N, H, K, slots = 6, 8, 128, 20
    inp = make_inputs(B=N, T=1, H=H, K=K, seed=11)
    pool = torch.randn(slots, H, K, K, device="cuda").to(pool_dtype)
    idx = torch.tensor([3, -1, 7, 0, 19, 12], dtype=torch.int32, device="cuda")
    before = pool.clone()
    out, st = fused_recurrent_kda_fwd(
        q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"],
        A_log=inp["A_log"], dt_bias=inp["dt_bias"].flatten(), initial_state=pool,
        inplace_final_state=True, state_v_first=True, ssm_state_indices=idx,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=-5.0)
    assert calls["fused_recurrent_kda_fwd"] == 1 and st is pool
    live = [n for n in range(N) if idx[n] >= 0]
    ref = dict(inp, initial_state=before[idx[live].long()],
               **{n: inp[n][live] for n in ("q", "k", "v", "g", "beta")})
    ref_o, ref_s = reference(ref)
    tol = STATE_TOL if pool_dtype == torch.float32 else 6e-3
    assert rel_err(out[live], ref_o) < OUT_TOL
    assert rel_err(pool[idx[live].long()], ref_s) < tol
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # the padding row
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[idx[live].long().cpu()] = False
    assert torch.equal(pool[untouched.cuda()], before[untouched.cuda()])
