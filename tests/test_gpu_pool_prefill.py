"""The prefill forward against a state pool on the H200 (`fwd` / `chunk_kda` with state_indices):
every schedule's K2 and the segments' combine read and write the pool's slots in place (skips
without a Hopper GPU + cubins).

Each pool is filled with a sentinel and sits between poisoned guard regions; after a call every
slot the call may not write is checked bit-identical and the guards untouched. Live sequences
are checked bit for bit against the dense forward on the same states (the same schedule, the
same arithmetic) and against the float64 reference; padding sequences output zeros."""

import pytest
import torch

import kda_cute
from kda_cute import Call, api, checks, plans
from kda_cute.reference import rel_err
from kda_cute.testing import GUARD, SENTINEL, make_inputs, reference
from kda_cute.testing import bits as _bits
from kda_cute.testing import guarded as _guarded
from kda_cute.testing import guards_ok as _guards_ok

pytestmark = pytest.mark.gpu

OUT_TOL, STATE_TOL = 3.5e-3, {torch.float32: 2.5e-3, torch.bfloat16: 6e-3}


def _fill_gaps_ok(buf, pool):
    """The elements between slots (pad) are untouched: every sentinel outside the slots."""
    inside = torch.zeros(buf.numel(), dtype=torch.bool, device="cuda")
    base = pool.data_ptr() // pool.element_size() - buf.data_ptr() // buf.element_size()
    per = pool.shape[1] * pool.shape[2] * pool.shape[3]
    for s in range(pool.shape[0]):
        start = base + s * pool.stride(0)
        inside[start:start + per] = True
    inside[:GUARD] = True
    inside[-GUARD:] = True
    return bool((buf[~inside] == SENTINEL).all())


def _case(K, dtype, idx_dtype, *, seqlens=None, B=1, T=64, H=4, pad_rows=(), null=False,
          out_slots=False, has_init=False, slot_pad=0, seed=0, gate="bounded"):
    """Inputs and a pool form of them: (inp, pool, buf, read, write, hi, kw). Live slots hold
    random states; pad_rows are padding (index -1, or 0 with null)."""
    inp = make_inputs(B=B, T=T, H=H, K=K, seqlens=seqlens, gate=gate, seed=seed,
                      state_dtype=dtype)
    N = inp["N"]
    slots = 4 * N + 1
    pool, buf = _guarded((slots, H, K, K), dtype, pad=slot_pad)
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    perm = torch.randperm(slots - 1, generator=gen, device="cuda")[:2 * N] + 1
    read, write = perm[:N].clone(), (perm[N:].clone() if out_slots else perm[:N].clone())
    pool[read] = inp["initial_state"]
    for n in pad_rows:
        read[n] = 0 if null else -1
        write[n] = 0 if null else -1
    hi = None
    if has_init:
        hi = torch.arange(N, device="cuda") % 3 != 1
    kw = dict(state_indices=read.to(idx_dtype),
              output_state_indices=write.to(idx_dtype) if out_slots else None,
              has_initial_state=hi, null_slot=0 if null else None)
    return inp, pool, buf, read, write, hi, kw


def _fwd(inp, out, s0, s1, config=None, segments=None, precision="fast", **kw):
    kda_cute.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out,
                 inp["A_log"], inp["dt_bias"], inp["lower_bound"], s0, s1, inp["cu_seqlens"],
                 gate=inp["gate"], config=config, segments=segments, precision=precision, **kw)


def _dense_twin(inp, pool, read, hi, dtype, **fwd_kw):
    """The dense forward on the states the pool form reads (zeros where has_init is False):
    (out, final)."""
    s0 = pool[read.clamp(min=0)].clone()
    if hi is not None:
        s0[~hi] = 0
    out = torch.full(inp["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    final = torch.full(s0.shape, float("nan"), dtype=dtype, device="cuda")
    _fwd(inp, out, s0, final, **fwd_kw)
    return out, final, s0


def _check(inp, pool, buf, before, read, write, hi, kw, dtype, pad_rows, **fwd_kw):
    """Run the pool form, then every check: outputs and written slots bit-identical to the
    dense twin's, within the bar of float64, zeros for padding rows, nothing else touched."""
    out = torch.full(inp["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    _fwd(inp, out, pool, pool, **fwd_kw, **kw)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    d_out, d_final, s0 = _dense_twin(inp, before, read, hi, dtype, **fwd_kw)
    torch.cuda.synchronize()
    ref_inp = dict(inp, initial_state=s0.float())
    ref_o, ref_s = reference(ref_inp)
    N = inp["N"]
    cu = inp["cu_seqlens"]
    T = inp["q"].shape[1]
    bounds = ([(int(cu[n]), int(cu[n + 1])) for n in range(N)] if cu is not None
              else [(n * T, (n + 1) * T) for n in range(N)])
    flat, d_flat = out.flatten(0, 1), d_out.flatten(0, 1)
    r_flat = ref_o.flatten(0, 1)
    for n, (b, e) in enumerate(bounds):
        if n in pad_rows:
            assert bool((flat[b:e] == 0).all()), f"padding row {n}: output not zero"
            continue
        assert torch.equal(flat[b:e].view(torch.int16), d_flat[b:e].view(torch.int16)), n
        if e > b:
            assert rel_err(flat[b:e], r_flat[b:e]) < OUT_TOL, n
        assert torch.equal(_bits(pool[write[n]]), _bits(d_final[n])), n
        assert rel_err(pool[write[n]], ref_s[n]) < STATE_TOL[dtype], n
    written = {int(write[n]) for n in range(N) if n not in pad_rows}
    rest = [s for s in range(pool.shape[0]) if s not in written]
    assert torch.equal(_bits(pool[rest]), _bits(before[rest]))
    assert _guards_ok(buf)
    assert _fill_gaps_ok(buf, pool)


VARLEN = [37, 0, 130, 1, 64, 300]


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("idx_dtype,null,out_slots,has_init", [
    (torch.int32, False, False, False), (torch.int64, True, True, True),
    (torch.int32, True, False, True), (torch.int64, False, True, False)],
    ids=["i32-inplace", "i64-null0-out-init", "i32-null0-init", "i64-out"])
def test_varlen_pool(K, dtype, idx_dtype, null, out_slots, has_init):
    pad_rows = (2,)  # a padding row with 130 tokens: zeros out, no state read or written
    inp, pool, buf, read, write, hi, kw = _case(
        K, dtype, idx_dtype, seqlens=VARLEN, pad_rows=pad_rows, null=null, out_slots=out_slots,
        has_init=has_init, slot_pad=8 if out_slots else 0, seed=K)
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, dtype, pad_rows)


@pytest.mark.parametrize("precision", ["fast", "precise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_segments_pool(dtype, precision):
    """Fixed length, few heads: K2 over segments and the combine read and write the pool (a bf16
    one straight, no fp32 copy); a padding row's segments output zeros."""
    pad_rows = (1,)
    inp, pool, buf, read, write, hi, kw = _case(
        128, dtype, torch.int32, B=3, T=300, H=2, pad_rows=pad_rows, out_slots=True,
        has_init=True, slot_pad=16, seed=3)
    p = checks.forward(Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                            torch.empty_like(inp["v"]), inp["A_log"], inp["dt_bias"], pool,
                            pool, None, inp["scale"], inp["lower_bound"], **kw),
                       checks.options(segments=3, precision=precision))
    assert str(plans.plan(p, checks.options(segments=3, precision=precision),
                          plans.device_info(inp["q"].device)).schedule) == "segments 3"
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, dtype, pad_rows, segments=3,
           precision=precision)


def test_alongside_pool():
    """K2 alongside K1 (two long sequences, few heads) against the pool."""
    inp, pool, buf, read, write, hi, kw = _case(128, torch.float32, torch.int32,
                                                seqlens=[2048, 1024], H=8, seed=5)
    p = checks.forward(Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                            torch.empty_like(inp["v"]), inp["A_log"], inp["dt_bias"], pool,
                            pool, inp["cu_seqlens"], inp["scale"], inp["lower_bound"], **kw),
                       checks.options())
    assert plans.plan(p, checks.options(), plans.device_info(inp["q"].device)).alongside
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, torch.float32, ())


def test_wy_and_many_sequences_per_cta_pool():
    """The WY-form K2 (grid within one CTA per SM), then a batch whose K2 CTAs run several
    sequences each, against a pool."""
    inp, pool, buf, read, write, hi, kw = _case(128, torch.float32, torch.int64, B=1, T=200,
                                                H=64, seed=6)
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, torch.float32, ())
    inp, pool, buf, read, write, hi, kw = _case(128, torch.bfloat16, torch.int32, B=24, T=64,
                                                H=16, pad_rows=(3, 17), seed=7)
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, torch.bfloat16, (3, 17))


def test_simt_pool():
    from kda_cute.ladder import SIMT
    cfg = next(c for c in SIMT if c.prep.head_dim_k == 64)
    inp, pool, buf, read, write, hi, kw = _case(64, torch.float32, torch.int32,
                                                seqlens=[20, 1, 50], pad_rows=(1,),
                                                has_init=True, seed=8)
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, torch.float32, (1,), config=cfg)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_length_one_row_equals_decode(dtype):
    """vLLM sends decode rows through the prefill call when a prefill is present: a length-1
    row of a prefill batch gives the decode kernel's result within the accuracy bar."""
    seqlens = [1, 77, 1, 1]
    inp, pool, buf, read, write, hi, kw = _case(128, dtype, torch.int32, seqlens=seqlens,
                                                seed=9)
    dec_pool = pool.clone()
    out = torch.full(inp["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    _fwd(inp, out, pool, pool, **kw)
    rows = [0, 78, 79]  # the token rows of the length-1 sequences
    ones = [0, 2, 3]
    q, k, v, g, beta = (inp[n][0, rows] for n in ("q", "k", "v", "g", "beta"))
    d_out = torch.full((3, 4, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    kda_cute.decode(q, k, v, g, beta, dec_pool, read[ones], out=d_out, A_log=inp["A_log"],
                    dt_bias=inp["dt_bias"], lower_bound=inp["lower_bound"])
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    assert rel_err(out[0, rows], d_out.double()) < OUT_TOL
    assert rel_err(pool[read[ones]], dec_pool[read[ones]].double()) < STATE_TOL[dtype]


def test_bad_indices_reported_and_never_followed():
    """Indices past the pool, and an int64 one beyond int32's range: the row is treated as
    padding (zeros, nothing read or written), the next pool call raises naming the argument."""
    inp, pool, buf, read, write, hi, kw = _case(64, torch.float32, torch.int64,
                                                seqlens=[30, 40, 50], out_slots=True, seed=10)
    slots = pool.shape[0]
    rows = [(0, 30), (30, 70), (70, 120)]
    before = pool.clone()

    def run_with(**change):
        out = torch.full(inp["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
        _fwd(inp, out, pool, pool, **{**kw, **change})
        torch.cuda.synchronize()
        return out[0]

    def only_written(slot_list):
        rest = [s for s in range(slots) if s not in slot_list]
        assert torch.equal(_bits(pool[rest]), _bits(before[rest]))
        for s_ in slot_list:
            assert not torch.equal(_bits(pool[s_]), _bits(before[s_]))

    bad_read = kw["state_indices"].clone()
    bad_read[0] = slots + 5
    bad_read[2] = (1 << 33) + 2  # low word 2, high word not the sign extension
    out = run_with(state_indices=bad_read)
    for n in (0, 2):
        assert bool((out[rows[n][0]:rows[n][1]] == 0).all()), n
    assert bool(torch.isfinite(out[30:70].float()).all())
    only_written([int(write[1])])
    with pytest.raises(kda_cute.DeviceValueError, match="state_indices"):
        run_with()
    kda_cute.check_errors(sync=True)  # the call that raised launched nothing, reported once
    pool.copy_(before)
    bad_write = kw["output_state_indices"].clone()
    bad_write[1] = slots
    out = run_with(output_state_indices=bad_write)
    assert bool((out[30:70] == 0).all())
    only_written([int(write[0]), int(write[2])])
    with pytest.raises(kda_cute.DeviceValueError, match="output_state_indices"):
        kda_cute.check_errors()
    assert _guards_ok(buf)


def test_cuda_graph_replay_with_new_indices():
    """A pool-form prefill captured once, replayed with new slots and has_initial_state flags,
    equals eager calls bit for bit."""
    inp, pool, buf, read, write, hi, kw = _case(128, torch.float32, torch.int32,
                                                seqlens=[40, 100, 7], has_init=True, seed=11)
    N = inp["N"]
    idx, flags = kw["state_indices"].clone(), hi.clone()
    out = torch.empty_like(inp["v"])
    kw = dict(kw, state_indices=idx, has_initial_state=flags)
    p = checks.forward(Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out,
                            inp["A_log"], inp["dt_bias"], pool, pool, inp["cu_seqlens"],
                            inp["scale"], inp["lower_bound"], **kw), checks.options())
    ws = torch.empty(kda_cute.workspace_bytes(p, api.config_for(p)), dtype=torch.uint8,
                     device="cuda")

    def step():
        kda_cute.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out,
                     inp["A_log"], inp["dt_bias"], inp["lower_bound"], pool, pool,
                     inp["cu_seqlens"], ws, check_seqlens=False, **kw)

    step()  # warm: plans, loads
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    gen = torch.Generator(device="cuda").manual_seed(12)
    for _ in range(3):
        start = (torch.randn(pool.shape, generator=gen, device="cuda") * 0.3)
        new = torch.randperm(pool.shape[0], generator=gen, device="cuda")[:N].to(torch.int32)
        new_flags = torch.rand(N, generator=gen, device="cuda") < 0.5
        pool.copy_(start)
        idx.copy_(new)
        flags.copy_(new_flags)
        graph.replay()
        torch.cuda.synchronize()
        got_o, got_p = out.clone(), pool.clone()
        pool.copy_(start)
        out.fill_(float("nan"))
        step()
        torch.cuda.synchronize()
        assert torch.equal(_bits(got_p), _bits(pool))
        assert torch.equal(got_o.view(torch.int16), out.view(torch.int16))
    kda_cute.check_errors(sync=True)


def test_chunk_kda_pool_form():
    """fla's call with the pool form: state_v_first=True, the pool updated in place and
    returned; a K-first pool is refused."""
    inp, pool, buf, read, write, hi, kw = _case(64, torch.float32, torch.int32,
                                                seqlens=[33, 90], seed=13)
    before = pool.clone()
    o, s = kda_cute.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                              initial_state=pool, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                              safe_gate=True, lower_bound=-5.0, A_log=inp["A_log"],
                              dt_bias=inp["dt_bias"], state_v_first=True,
                              cu_seqlens=inp["cu_seqlens"], state_indices=kw["state_indices"],
                              use_beta_sigmoid_in_kernel=True)
    assert s is pool
    d_out, d_final, _ = _dense_twin(inp, before, read, None, torch.float32)
    torch.cuda.synchronize()
    assert torch.equal(o.view(torch.int16), d_out.view(torch.int16))
    assert torch.equal(_bits(pool[read]), _bits(d_final))
    with pytest.raises(ValueError, match="state_v_first"):
        kda_cute.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                           initial_state=pool, state_indices=kw["state_indices"],
                           cu_seqlens=inp["cu_seqlens"])


def test_bound_pool_prefill():
    """A pool-form forward bound once (kda_cute.bind) runs on refilled slots like fwd, and
    reports an earlier call's bad index before launching."""
    inp, pool, buf, read, write, hi, kw = _case(128, torch.float32, torch.int32,
                                                seqlens=[40, 100], seed=14)
    idx = kw["state_indices"].clone()
    out = torch.full(inp["v"].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    call = Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, inp["A_log"],
                inp["dt_bias"], pool, pool, inp["cu_seqlens"], inp["scale"],
                inp["lower_bound"], idx)
    opts = checks.options()
    bound = kda_cute.bind(plans.plan(checks.forward(call, opts), opts,
                                     plans.device_info(inp["q"].device)), call)
    before = pool.clone()
    bound()
    torch.cuda.synchronize()
    got_o, got_p = out.clone(), pool.clone()
    pool.copy_(before)
    _fwd(inp, out, pool, pool, state_indices=idx)
    torch.cuda.synchronize()
    assert torch.equal(got_o.view(torch.int16), out.view(torch.int16))
    assert torch.equal(_bits(got_p), _bits(pool))
    idx[1] = pool.shape[0] + 3
    bound()
    torch.cuda.synchronize()
    with pytest.raises(kda_cute.DeviceValueError, match="state_indices"):
        bound()
    kda_cute.check_errors(sync=True)
