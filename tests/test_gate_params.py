"""Gate parameters (A_log, dt_bias) in the dtypes models hold them, on the GPU: fp32, bf16 or
fp16 in every public call (fwd, chunk_kda, decode, verify, recurrent, fused_recurrent_kda_fwd,
the fla backend), read by the kernels as held. A call with bf16 / fp16 parameters gives bit for
bit what the call with the same (rounded) values in fp32 gives, so the float64 bar of the fp32
call carries over; views that start at any element (an odd offset) are read in place; a CUDA
graph captured with them stays valid and allocates nothing per replay. Skips without a Hopper
GPU and the cubins."""

import pytest
import torch

import kda_cute
from kda_cute.reference import rel_err
from kda_cute.testing import make_inputs, reference

pytestmark = pytest.mark.gpu

BF, F16, F32 = torch.bfloat16, torch.float16, torch.float32
OUT_TOL, STATE_TOL = 3.5e-3, 2.5e-3


def _held(t: torch.Tensor, dtype, offset: int = 0) -> torch.Tensor:
    """t in `dtype`, as a view `offset` elements into a larger buffer (poisoned around it)."""
    buf = torch.full((t.numel() + offset + 7,), float("nan"), dtype=dtype, device=t.device)
    view = buf[offset:offset + t.numel()].view(t.shape)
    view.copy_(t.to(dtype))
    return view


def _fwd(inp, A_log, dt_bias, gate):
    q, v = inp["q"], inp["v"]
    B, T, H, V = v.shape
    out = torch.full_like(v, float("nan"))
    final = torch.full((inp["N"], H, V, q.shape[-1]), float("nan"), device=q.device)
    kda_cute.fwd(q, inp["k"], v, inp["g"], inp["beta"], inp["scale"], out, A_log, dt_bias,
                 inp["lower_bound"], inp["initial_state"], final, inp["cu_seqlens"], gate=gate)
    torch.cuda.synchronize()
    return out, final


@pytest.mark.parametrize("gate", ["bounded", "unbounded"])
@pytest.mark.parametrize("dtype, offset", [(BF, 0), (F16, 0), (BF, 1), (F16, 3)])
@pytest.mark.parametrize("K, seqlens", [(128, None), (64, [300, 7, 1000]), (256, [129, 60])])
def test_prefill_reads_gate_params_as_held(gate, dtype, offset, K, seqlens):
    inp = make_inputs(B=2, T=200, H=4, K=K, seqlens=seqlens, gate=gate, seed=K + offset)
    # values a model holds: fp32 parameters rounded to `dtype`
    a16 = _held(inp["A_log"] * 2 - 1, dtype, offset)
    b16 = _held(inp["dt_bias"] * 2 - 1, dtype, offset + 1)
    o16, s16 = _fwd(inp, a16, b16, gate)
    o32, s32 = _fwd(inp, a16.float(), b16.float(), gate)
    assert torch.equal(o16, o32) and torch.equal(s16, s32)
    ref_o, ref_s = reference(dict(inp, A_log=a16.float(), dt_bias=b16.float()))
    assert rel_err(o16, ref_o) < OUT_TOL and rel_err(s16, ref_s) < STATE_TOL
    # one of the two in fp32, the other 16-bit: each read as held
    o_mixed, _ = _fwd(inp, a16.float(), b16, gate)
    assert torch.equal(o_mixed, o32)


@pytest.mark.parametrize("dtype", [BF, F16])
def test_chunk_kda_and_fla_backend_take_bf16_gate_params(dtype):
    """fla's chunk_kda through the backend with a model's bf16 / fp16 A_log and dt_bias [H*K]
    (the call that once raised "A_log: expected dtype float32")."""
    fla_kda = pytest.importorskip("fla.ops.kda")
    from kda_cute.integrations import fla as kda_fla
    kda_fla.register()
    inp = make_inputs(seqlens=[300, 77, 1024], H=4, K=128, seed=5)
    a16, b16 = _held(inp["A_log"], dtype), _held(inp["dt_bias"].flatten(), dtype)
    kw = dict(q=inp["q"], k=inp["k"], v=inp["v"], g=inp["g"], beta=inp["beta"],
              initial_state=inp["initial_state"], output_final_state=True,
              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
              use_beta_sigmoid_in_kernel=True, safe_gate=True, lower_bound=-5.0,
              state_v_first=True, cu_seqlens=inp["cu_seqlens"])
    backend = kda_fla.KdaCuteBackend()
    assert backend.chunk_kda_verifier(A_log=a16, dt_bias=b16, **kw) == (True, None)
    with torch.inference_mode():
        o, s = fla_kda.chunk_kda(A_log=a16, dt_bias=b16, **kw)
        o32, s32 = kda_cute.chunk_kda(A_log=a16.float(), dt_bias=b16.float(), **kw)
    assert torch.equal(o, o32) and torch.equal(s, s32)


def _step_inputs(N, H, K, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    t = [torch.randn(N, 1, H, K, generator=gen, device="cuda").to(BF) for _ in range(4)]
    beta = torch.randn(N, 1, H, generator=gen, device="cuda").to(BF)
    A_log = torch.randn(H, generator=gen, device="cuda") * 0.5
    dt_bias = torch.randn(H * K, generator=gen, device="cuda") * 0.5
    return t, beta, A_log, dt_bias


@pytest.mark.parametrize("dtype, offset", [(BF, 0), (F16, 1)])
@pytest.mark.parametrize("pool_dtype", [F32, BF])
def test_serving_calls_read_gate_params_as_held(dtype, offset, pool_dtype):
    """decode, verify, recurrent and fla's fused_recurrent_kda_fwd: the same bits as with the
    fp32 copies of the parameters."""
    N, H, K, slots = 6, 4, 128, 16
    (q, k, g, v), beta, A_log, dt_bias = _step_inputs(N, H, K, 7)
    a16, b16 = _held(A_log, dtype, offset), _held(dt_bias, dtype, offset)
    pool0 = torch.randn(slots, H, K, K, device="cuda").to(pool_dtype)
    idx = torch.tensor([3, -1, 7, 0, 15, 12], dtype=torch.int32, device="cuda")
    outs = []
    for a, b in ((a16, b16), (a16.float(), b16.float())):
        pool = pool0.clone()
        o = kda_cute.decode(q, k, v, g, beta, pool, idx, A_log=a, dt_bias=b, lower_bound=-5.0)
        pool_v = pool0.clone()
        ov = kda_cute.verify(q, k, v, g, beta, pool_v, ssm_state_indices=idx[:, None],
                             A_log=a, dt_bias=b, gate="unbounded")
        s0 = pool0[:N].clone()
        orr = kda_cute.recurrent(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                 g.transpose(0, 1), beta.transpose(0, 1), s0, s0,
                                 cu_seqlens=torch.arange(N + 1, device="cuda"), A_log=a,
                                 dt_bias=b, lower_bound=-5.0)
        pool_f = pool0.clone()
        of, _ = kda_cute.fused_recurrent_kda_fwd(
            q, k, v, g, beta, A_log=a, dt_bias=b, initial_state=pool_f,
            inplace_final_state=True, state_v_first=True, ssm_state_indices=idx,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
            use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
        torch.cuda.synchronize()
        outs.append((o, pool, ov, pool_v, orr, s0, of, pool_f))
    for x16, x32 in zip(*outs, strict=True):
        assert torch.equal(x16, x32)


def test_graph_with_bf16_gate_params_replays_without_allocating():
    """A captured forward and decode with bf16 parameters: replays follow new parameter values
    written in place, and replaying allocates nothing."""
    inp = make_inputs(B=1, T=256, H=4, K=128, seed=9)
    a16, b16 = _held(inp["A_log"], BF), _held(inp["dt_bias"], BF)
    out = torch.empty_like(inp["v"])
    final = torch.empty(1, 4, 128, 128, device="cuda")
    (q, k, g, v), beta, _, _ = _step_inputs(3, 4, 128, 10)
    pool = torch.randn(5, 4, 128, 128, device="cuda")
    idx = torch.tensor([4, 0, 2], dtype=torch.int32, device="cuda")

    def step():
        kda_cute.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out,
                     a16, b16, -5.0, inp["initial_state"], final)
        return kda_cute.decode(q, k, v, g, beta, pool, idx, A_log=a16, dt_bias=b16.flatten(),
                               lower_bound=-5.0)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm: plans and scratch made outside the capture
    torch.cuda.current_stream().wait_stream(s)
    pool0 = pool.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec = step()
    for scale in (0.5, -1.0):
        a16.copy_((inp["A_log"] * scale).to(BF))
        b16.copy_((inp["dt_bias"] * scale).to(BF))
        pool.copy_(pool0)
        before = torch.cuda.memory_allocated()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before
        got_o, got_s, got_d, got_p = out.clone(), final.clone(), dec.clone(), pool.clone()
        pool.copy_(pool0)
        eo, es = _fwd(inp, a16.float(), b16.float(), "bounded")
        ed = kda_cute.decode(q, k, v, g, beta, pool, idx, A_log=a16.float(),
                             dt_bias=b16.float().flatten(), lower_bound=-5.0)
        torch.cuda.synchronize()
        assert torch.equal(got_o, eo) and torch.equal(got_s, es)
        assert torch.equal(got_d, ed) and torch.equal(got_p, pool)
