"""torch.library ops on a CPU: their schemas, torch.compile(fullgraph=True) tracing each public
function into them on FakeTensors (CUDA tensors need no GPU there), functionalization
(aot_eager), the metadata checks raising at trace time, and the eager bypass."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

import kda_cute
from kda_cute import declare

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
