"""torch.library ops. On a CPU: their schemas, torch.compile(fullgraph=True) tracing each public
function into them on FakeTensors (CUDA tensors need no GPU there), functionalization
(aot_eager), the metadata checks raising at trace time, and the eager bypass. On the H200 (the
tests marked gpu): torch.library.opcheck on each op (schema and mutation, fake against real, AOT
dispatch with dynamic shapes), a small KDA layer compiled with torch.compile(fullgraph=True)
(inductor) against eager, and a CUDA graph of the compiled layer replayed on new inputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import kda_cute
from kda_cute import declare
from kda_cute.reference import rel_err
from kda_cute.testing import make_inputs

BF, F32, I32 = torch.bfloat16, torch.float32, torch.int32
H, K = 4, 128


@pytest.fixture
def fake():
    torch._dynamo.reset()
    with FakeTensorMode() as mode:
        yield mode
    torch._dynamo.reset()


def cuda(*shape, dtype=BF):
    return torch.empty(*shape, dtype=dtype, device="cuda")


def prefill_inputs(B=1, T=200):
    q, k, v, g = (cuda(B, T, H, K) for _ in range(4))
    return q, k, v, g, cuda(B, T, H), cuda(H, dtype=F32), cuda(H, K, dtype=F32)


def traced(fn, *args, backend="capture", dynamic=None):
    """fn compiled with fullgraph=True and run on FakeTensors; the ops in its graph."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    out = torch.compile(fn, backend=capture if backend == "capture" else backend,
                        fullgraph=True, dynamic=dynamic)(*args)
    ops = [str(n.target) for gm in graphs for n in gm.graph.nodes
           if n.op == "call_function" and str(n.target).startswith("kda_cute.")]
    return out, ops


def test_schemas_name_what_each_op_writes():
    written = {}
    for name in declare.OPS:
        schema = getattr(torch.ops.kda_cute, name).default._schema
        written[name] = sorted(a.name for a in schema.arguments
                               if a.alias_info is not None and a.alias_info.is_write)
        assert not schema.returns, name  # outputs are the caller's tensors
    assert written == {
        "fwd": ["checkpoint_state", "final_state", "out", "workspace"],
        "fwd_inplace": ["checkpoint_state", "out", "state", "workspace"],
        "decode": ["out", "state"],
        "verify": ["out", "state"],
        "verify_scratch": ["intermediate_states", "out"],
        "commit": ["state"],
        "recurrent": ["final_state", "out"],
        "recurrent_inplace": ["out", "state"],
        "replay_decode": ["cursor", "out", "ring_g", "ring_k", "ring_r", "ring_u", "state",
                          "tickets"],
        "replay_verify": ["out", "ring_g", "ring_k", "ring_r", "ring_u"],
        "replay_commit": ["cursor"],
        "replay_flush": ["cursor", "state", "tickets"],
    }


def test_chunk_kda_traces_into_fwd(fake):
    q, k, v, g, beta, A, dt = prefill_inputs()
    s0 = cuda(1, H, K, K, dtype=F32)

    def layer(q, k, v, g, beta, A, dt, s0):
        o, s = kda_cute.chunk_kda(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                  use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                                  use_beta_sigmoid_in_kernel=True, safe_gate=True,
                                  lower_bound=-5.0, A_log=A, dt_bias=dt, state_v_first=True)
        return o * 2, s

    (o, s), ops = traced(layer, q, k, v, g, beta, A, dt, s0)
    assert ops == ["kda_cute.fwd.default"]
    assert o.shape == v.shape and o.dtype == BF and s.shape == s0.shape and s.dtype == F32


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("in_place", [False, True])
def test_fwd_state_in_place_is_one_in_out_tensor(fake, in_place, dynamic):
    q, k, v, g, beta, A, dt = prefill_inputs()
    s0 = cuda(1, H, K, K, dtype=F32)
    s1 = s0 if in_place else cuda(1, H, K, K, dtype=F32)

    def step(q, k, v, g, beta, A, dt, s0, s1):
        out = torch.empty_like(v)
        kda_cute.fwd(q, k, v, g, beta, K ** -0.5, out, A, dt, -5.0, s0, s1)
        return out

    _, ops = traced(step, q, k, v, g, beta, A, dt, s0, s1, dynamic=dynamic)
    assert ops == ["kda_cute.fwd_inplace.default" if in_place else "kda_cute.fwd.default"]
    # functionalized
    traced(step, q, k, v, g, beta, A, dt, s0, s1, backend="aot_eager", dynamic=dynamic)


def test_pool_prefill_with_checkpoints_traces(fake):
    q, k, v, g, beta, A, dt = prefill_inputs(T=300)
    cu = torch.tensor([0, 100, 300], device="cuda")
    pool, idx = cuda(5, H, K, K, dtype=F32), torch.tensor([3, 1], dtype=I32, device="cuda")
    ck, offs = cuda(2, 2, H, K, K, dtype=F32), torch.full((2, 2), 64, device="cuda")

    def step(q, k, v, g, beta, A, dt, pool, idx, cu, ck, offs):
        out = torch.empty_like(v)
        kda_cute.fwd(q, k, v, g, beta, K ** -0.5, out, A, dt, -5.0, pool, pool, cu,
                     state_indices=idx, checkpoint_state=ck, checkpoint_offsets=offs)
        return out

    _, ops = traced(step, q, k, v, g, beta, A, dt, pool, idx, cu, ck, offs)
    assert ops == ["kda_cute.fwd_inplace.default"]
    traced(step, q, k, v, g, beta, A, dt, pool, idx, cu, ck, offs, backend="aot_eager")


@pytest.mark.parametrize("dynamic", [None, True])
def test_serving_calls_trace(fake, dynamic):
    N, T, slots = 3, 4, 10
    q1, beta1 = cuda(N, 1, H, K), cuda(N, 1, H)
    qv, bv = cuda(N, T, H, K), cuda(N, T, H)
    A, dt = cuda(H, dtype=F32), cuda(H, K, dtype=F32)
    pool = cuda(slots, H, K, K, dtype=F32)
    idx = torch.arange(N, dtype=I32, device="cuda")
    sidx = torch.zeros(N, T, dtype=I32, device="cuda")
    acc = torch.ones(N, dtype=I32, device="cuda")
    inter = cuda(N, T, H, K, K, dtype=F32)
    dense = cuda(N, H, K, K, dtype=F32)

    def serve(q1, beta1, qv, bv, A, dt, pool, idx, sidx, acc, inter, dense):
        o1 = kda_cute.decode(q1, q1, q1, q1, beta1, pool, idx, A_log=A, dt_bias=dt,
                             lower_bound=-5.0)
        oa = kda_cute.verify(qv, qv, qv, qv, bv, pool, ssm_state_indices=sidx,
                             num_accepted_tokens=acc, A_log=A, dt_bias=dt, lower_bound=-5.0)
        ob = kda_cute.verify(qv, qv, qv, qv, bv, pool, state_indices=idx,
                             intermediate_states=inter, A_log=A, dt_bias=dt, lower_bound=-5.0)
        kda_cute.commit(pool, inter, idx, acc)
        of, _ = kda_cute.fused_recurrent_kda_fwd(
            qv, qv, qv, qv, bv, A_log=A, dt_bias=dt.flatten(), initial_state=dense,
            inplace_final_state=True, state_v_first=True, use_qk_l2norm_in_kernel=True,
            use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
        return o1, oa + ob + of

    (o1, o2), ops = traced(serve, q1, beta1, qv, bv, A, dt, pool, idx, sidx, acc, inter, dense,
                           dynamic=dynamic)
    assert ops == ["kda_cute.decode.default", "kda_cute.verify.default",
                   "kda_cute.verify_scratch.default", "kda_cute.commit.default",
                   "kda_cute.recurrent_inplace.default"]
    assert o1.shape == q1.shape and o2.shape == qv.shape
    traced(serve, q1, beta1, qv, bv, A, dt, pool, idx, sidx, acc, inter, dense,
           backend="aot_eager", dynamic=dynamic)


@pytest.mark.parametrize("dynamic", [None, True])
def test_replay_calls_trace(fake, dynamic):
    N, T, slots, L = 3, 4, 10, 16
    q1, beta1 = cuda(N, 1, H, K), cuda(N, 1, H)
    qv, bv = cuda(N, T, H, K), cuda(N, T, H)
    A, dt = cuda(H, dtype=F32), cuda(H, K, dtype=F32)
    pool = cuda(slots, H, K, K, dtype=F32)
    ring = dict(ring_k=cuda(slots, H, L, K), ring_r=cuda(slots, H, L, dtype=F32),
                ring_u=cuda(slots, H, L, K, dtype=torch.float16),
                ring_g=cuda(slots, H, L, K, dtype=F32), cursor=cuda(slots, dtype=I32),
                tickets=cuda(slots, dtype=I32))
    idx = torch.arange(N, dtype=I32, device="cuda")
    acc = torch.ones(N, dtype=I32, device="cuda")

    def serve(q1, beta1, qv, bv, A, dt, pool, idx, acc, ring_k, ring_r, ring_u, ring_g, cursor,
              tickets):
        r = dict(ring_k=ring_k, ring_r=ring_r, ring_u=ring_u, ring_g=ring_g, cursor=cursor,
                 tickets=tickets)
        o1 = kda_cute.replay_decode(q1, q1, q1, q1, beta1, pool, **r, state_indices=idx,
                                    window=8, A_log=A, dt_bias=dt, lower_bound=-5.0)
        ov = kda_cute.replay_verify(qv, qv, qv, qv, bv, pool, **r, state_indices=idx,
                                    A_log=A, dt_bias=dt, lower_bound=-5.0)
        kda_cute.replay_commit(**r, state_indices=idx, num_accepted_tokens=acc)
        kda_cute.replay_flush(pool, **r, state_indices=idx)
        return o1, ov

    args = (q1, beta1, qv, bv, A, dt, pool, idx, acc, *ring.values())
    (o1, ov), ops = traced(serve, *args, dynamic=dynamic)
    assert ops == ["kda_cute.replay_decode.default", "kda_cute.replay_verify.default",
                   "kda_cute.replay_commit.default", "kda_cute.replay_flush.default"]
    assert o1.shape == q1.shape and ov.shape == qv.shape
    traced(serve, *args, backend="aot_eager", dynamic=dynamic)


def test_bad_metadata_raises_while_tracing_naming_the_argument(fake):
    q, k, v, g, beta, A, dt = prefill_inputs()

    def step(q, k, v, g, beta, A, dt):
        out = torch.empty_like(v)
        kda_cute.fwd(q, k, v, g, beta, K ** -0.5, out, A, dt, -5.0)
        return out

    with pytest.raises(Exception, match="g:"):
        traced(step, q, k, v, g.float(), beta, A, dt)
    torch._dynamo.reset()
    pool = cuda(4, H, K, K, dtype=F32)
    with pytest.raises(Exception, match="state_indices"):
        traced(lambda q, pool: kda_cute.decode(q, q, q, q, q[..., 0], pool,
                                               torch.zeros(5, dtype=torch.float32,
                                                           device="cuda"), lower_bound=-5.0),
               cuda(3, 1, H, K), pool)


def test_traced_calls_refuse_what_an_op_cannot_take(fake):
    q = cuda(3, 1, H, K)
    pool = cuda(4, H, K, K, dtype=F32)
    with pytest.raises(Exception, match="bind: expected False under torch.compile"):
        traced(lambda q, pool: kda_cute.decode(q, q, q, q, q[..., 0], pool, lower_bound=-5.0,
                                               bind=True), q, pool)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_eager_calls_bypass_the_dispatcher():
    """Eagerly the public functions run their own body: no kda_cute op is dispatched (the CPU
    tensors here fail the CUDA check, in the body)."""
    q = torch.randn(1, 64, H, K).to(BF)
    beta = torch.randn(1, 64, H).to(BF)
    with _Count() as seen, pytest.raises(ValueError, match="CUDA"):
        kda_cute.fwd(q, q, q, q, beta, 0.1, torch.empty_like(q), torch.zeros(H),
                     torch.zeros(H, K), -5.0)
    with _Count() as seen2, pytest.raises(ValueError, match="CUDA"):
        kda_cute.decode(q[:, :1], q[:, :1], q[:, :1], q[:, :1], beta[:, :1],
                        torch.zeros(2, H, K, K), lower_bound=-5.0)
    assert not [o for o in seen.ops + seen2.ops if o.startswith("kda_cute.")]


def test_fake_needs_no_device_and_reads_no_data(fake):
    """The fakes run on FakeTensors under FakeTensorMode directly (no GPU here)."""
    q, k, v, g, beta, A, dt = prefill_inputs()
    out = torch.empty_like(v)
    torch.ops.kda_cute.fwd(q, k, v, g, beta, 0.1, out, A, dt, -5.0, None, None, None, None,
                           "bounded", True, True, False, None, "fast", None, None, None, None,
                           None, None, None, None, None)
    with pytest.raises(ValueError, match="lower_bound"):
        torch.ops.kda_cute.fwd(q, k, v, g, beta, 0.1, out, A, dt, 1.0, None, None, None, None,
                               "bounded", True, True, False, None, "fast", None, None, None,
                               None, None, None, None, None, None)


def test_traced_verify_refuses_mixed_styles(fake):
    N, T = 2, 3
    qv, bv = cuda(N, T, H, K), cuda(N, T, H)
    pool = cuda(8, H, K, K, dtype=F32)
    sidx = torch.zeros(N, T, dtype=I32, device="cuda")
    inter = cuda(N, T, H, K, K, dtype=F32)
    with pytest.raises(Exception, match="two verify styles"):
        traced(lambda q, b, p, s, i: kda_cute.verify(q, q, q, q, b, p, ssm_state_indices=s,
                                                     intermediate_states=i, lower_bound=-5.0),
               qv, bv, pool, sidx, inter)


# On the GPU: each test below is marked gpu (tests/conftest.py skips it where the kernels
# cannot run).

# test_autograd_registration needs inputs that require grad: the ops are forward only
OPCHECK = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs or {}, test_utils=OPCHECK)


def _prefill():
    inp = make_inputs(B=2, T=200, H=H, K=K, seed=3)
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    return inp, (q, k, v, g, beta, inp["scale"])


FWD_REST = dict(gate="bounded", qk_l2norm=True, beta_sigmoid=True, check_seqlens=False,
                segments=None, precision="fast", state_indices=None, output_state_indices=None,
                has_initial_state=None, null_slot=None, checkpoint_state=None,
                checkpoint_offsets=None, checkpoint_slots=None, checkpoint_every=None,
                checkpoint_first=None)


@pytest.mark.gpu
def test_opcheck_fwd():
    inp, head = _prefill()
    out = torch.empty_like(inp["v"])
    s1 = torch.empty_like(inp["initial_state"])
    _opcheck(torch.ops.kda_cute.fwd.default,
             (*head, out, inp["A_log"], inp["dt_bias"], -5.0, inp["initial_state"], s1, None,
              None), FWD_REST)


@pytest.mark.gpu
def test_opcheck_fwd_inplace_with_checkpoints():
    inp, head = _prefill()
    out = torch.empty_like(inp["v"])
    state = inp["initial_state"].clone()
    ck = torch.randn(2, 2, H, K, K, device="cuda")
    offs = torch.tensor([[64, 130], [1, 200]], device="cuda")
    _opcheck(torch.ops.kda_cute.fwd_inplace.default,
             (*head, out, inp["A_log"], inp["dt_bias"], -5.0, state, None, None),
             {**FWD_REST, "checkpoint_state": ck, "checkpoint_offsets": offs})


def _tokens(N, T, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def r(*s):
        return torch.randn(*s, generator=gen, device="cuda").to(BF)

    return r(N, T, H, K), r(N, T, H, K), r(N, T, H, K), r(N, T, H, K), r(N, T, H)


def _gate():
    gen = torch.Generator(device="cuda").manual_seed(9)
    return (torch.randn(H, generator=gen, device="cuda") * 0.5,
            torch.randn(H, K, generator=gen, device="cuda") * 0.5)


@pytest.mark.gpu
def test_opcheck_decode_verify_commit():
    N, slots = 3, 12
    A, dt = _gate()
    pool = torch.randn(slots, H, K, K, device="cuda")
    q, k, v, g, beta = _tokens(N, 1)
    idx = torch.tensor([4, 0, 7], dtype=I32, device="cuda")
    gate = dict(gate="bounded", qk_l2norm=True, beta_sigmoid=True, null_slot=None)
    _opcheck(torch.ops.kda_cute.decode.default,
             (q, k, v, g, beta, pool, idx, torch.empty_like(v), None, None, A, dt, None, -5.0),
             gate)
    T = 3
    q, k, v, g, beta = _tokens(N, T, 1)
    sidx = torch.arange(N * T, dtype=I32, device="cuda").view(N, T)
    acc = torch.tensor([1, 2, 3], dtype=I32, device="cuda")
    style = dict(cu_seqlens=None, ssm_state_indices=None, num_accepted_tokens=None,
                 state_indices=None, intermediate_states=None, intermediate_state_indices=None,
                 retrieve_parent_token=None, out=torch.empty_like(v), A_log=A, dt_bias=dt,
                 scale=None, lower_bound=-5.0, **gate)
    _opcheck(torch.ops.kda_cute.verify.default, (q, k, v, g, beta, pool),
             {**style, "ssm_state_indices": sidx, "num_accepted_tokens": acc})
    inter = torch.randn(N, T, H, K, K, device="cuda")
    _opcheck(torch.ops.kda_cute.verify_scratch.default, (q, k, v, g, beta, pool),
             {**style, "state_indices": idx, "intermediate_states": inter})
    _opcheck(torch.ops.kda_cute.commit.default, (pool, inter, idx, acc - 1, None, None))


@pytest.mark.gpu
def test_opcheck_recurrent():
    N, T = 2, 5
    A, dt = _gate()
    q, k, v, g, beta = _tokens(N, T, 2)
    s0 = torch.randn(N, H, K, K, device="cuda")
    rest = dict(gate="bounded", qk_l2norm=True, beta_sigmoid=True)
    _opcheck(torch.ops.kda_cute.recurrent.default,
             (q, k, v, g, beta, s0, torch.empty_like(s0), None, torch.empty_like(v), A, dt,
              None, -5.0), rest)
    _opcheck(torch.ops.kda_cute.recurrent_inplace.default,
             (q, k, v, g, beta, s0.clone(), None, torch.empty_like(v), A, dt, None, -5.0), rest)


class KDALayer(torch.nn.Module):
    """A Kimi-style KDA block: q/k/v projections with a causal depthwise short convolution, the
    gate and beta projections, KDA (kda_cute.chunk_kda), a gated RMS norm and the output
    projection."""

    def __init__(self, D=512, conv=4):
        super().__init__()
        gen = torch.Generator(device="cuda").manual_seed(5)

        def w(*s, scale=None):
            scale = scale or s[-1] ** -0.5
            return torch.nn.Parameter((torch.randn(*s, generator=gen, device="cuda") * scale)
                                      .to(BF), requires_grad=False)

        self.w_qkv = w(3 * H * K, D)
        self.conv = w(3 * H * K, 1, conv, scale=0.5)
        self.w_f, self.w_b, self.w_g = w(H * K, D), w(H, D), w(H * K, D)
        self.w_o = w(D, H * K)
        self.A_log = torch.nn.Parameter(torch.rand(H, generator=gen, device="cuda"),
                                        requires_grad=False)
        self.dt_bias = torch.nn.Parameter(torch.rand(H * K, generator=gen, device="cuda"),
                                          requires_grad=False)
        self.k_conv = conv

    def forward(self, x, state):
        B, T, _ = x.shape
        qkv = F.linear(x, self.w_qkv).transpose(1, 2)
        qkv = F.conv1d(F.pad(qkv, (self.k_conv - 1, 0)), self.conv, groups=3 * H * K)
        q, k, v = F.silu(qkv).transpose(1, 2).contiguous().view(B, T, 3, H, K).unbind(2)
        g = F.linear(x, self.w_f).view(B, T, H, K)
        beta = F.linear(x, self.w_b)
        o, s = kda_cute.chunk_kda(q, k, v, g, beta, initial_state=state,
                                  output_final_state=True, use_qk_l2norm_in_kernel=True,
                                  use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                                  safe_gate=True, lower_bound=-5.0, A_log=self.A_log,
                                  dt_bias=self.dt_bias, state_v_first=True)
        o = F.rms_norm(o.float(), (K,)).to(BF) * torch.sigmoid(
            F.linear(x, self.w_g).view(B, T, H, K))
        return F.linear(o.reshape(B, T, H * K), self.w_o), s


def _layer_inputs(seed, B=2, T=300, D=512):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(B, T, D, generator=gen, device="cuda").to(BF),
            torch.randn(B, H, K, K, generator=gen, device="cuda") * 0.1)


@pytest.mark.gpu
@torch.no_grad()
def test_compiled_layer_fullgraph_matches_eager_and_replays_as_a_graph():
    from torch._inductor.compile_fx import compile_fx
    layer = KDALayer()
    seen = []

    def inductor(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return compile_fx(gm, example_inputs)

    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=inductor, fullgraph=True)
    x, s0 = _layer_inputs(1)
    y_e, s_e = layer(x, s0)
    y_c, s_c = compiled(x, s0)
    assert "kda_cute.fwd.default" in seen
    # inductor fuses the convolution, SiLU and norm its own way: KDA's inputs may differ by a
    # bf16 rounding, hence not bit for bit (the op itself is: opcheck above)
    assert torch.isfinite(y_c.float()).all() and torch.isfinite(s_c).all()
    assert rel_err(y_c, y_e) < 1e-2 and rel_err(s_c, s_e) < 1e-2, \
        (rel_err(y_c, y_e), rel_err(s_c, s_e))

    # the compiled layer captured once, replayed on new inputs
    sx, ss = x.clone(), s0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            compiled(sx, ss)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gy, gs = compiled(sx, ss)
    for seed in (2, 3):
        x2, s2 = _layer_inputs(seed)
        sx.copy_(x2)
        ss.copy_(s2)
        gy.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        y2, st2 = compiled(x2, s2)
        assert torch.equal(gy, y2) and torch.equal(gs, st2)
        y_e2, _ = layer(x2, s2)
        assert rel_err(gy, y_e2) < 1e-2


@pytest.mark.gpu
@torch.no_grad()
def test_compiled_decode_step_matches_eager():
    N, slots = 8, 32
    A, dt = _gate()
    pool = torch.randn(slots, H, K, K, device="cuda")
    q, k, v, g, beta = _tokens(N, 1, 4)
    idx = torch.randperm(slots, device="cuda")[:N].to(I32)

    def step(q, k, v, g, beta, pool, idx):
        return kda_cute.decode(q, k, v, g, beta, pool, idx, A_log=A, dt_bias=dt,
                               lower_bound=-5.0) * 2

    torch._dynamo.reset()
    p_e, p_c = pool.clone(), pool.clone()
    o_e = step(q, k, v, g, beta, p_e, idx)
    o_c = torch.compile(step, fullgraph=True)(q, k, v, g, beta, p_c, idx)
    assert torch.equal(o_e, o_c) and torch.equal(p_e, p_c)  # the same kernel on the same data
