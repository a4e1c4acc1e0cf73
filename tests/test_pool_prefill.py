"""The prefill forward against a state pool (`fwd` / `chunk_kda` with state_indices).

On a CPU: its argument checks (each bad input named), the Problem they describe, and the plan's
pool-form arguments for every schedule (K2's index mode, slots and tables; the segments' combine
reading and writing the pool, the last segment run reading the table for padding only).

On the H200 (the tests marked gpu): every schedule's K2 and the segments' combine read and write
the pool's slots in place. Each pool is filled with a sentinel and sits between poisoned guard
regions; after a call every slot the call may not write is checked bit-identical and the guards
untouched. Live sequences are checked bit for bit against the dense forward on the same states
(the same schedule, the same arithmetic) and against the float64 reference; padding sequences
output zeros."""

import pytest
import torch

import kda_cute
from kda_cute import Call, api, checks, plans
from kda_cute.plans.steps import Errors, Role, Scalar
from kda_cute.reference import rel_err
from kda_cute.specs.recur import INDEX_DENSE, INDEX_PAD, INDEX_POOL
from kda_cute.testing import GUARD, SENTINEL, make_inputs, reference
from kda_cute.testing import bits as _bits
from kda_cute.testing import guarded as _guarded
from kda_cute.testing import guards_ok as _guards_ok
from tests import launch_record

BF, F32 = torch.bfloat16, torch.float32
needs_manifests = pytest.mark.skipif(not launch_record.CUBIN_DIR.exists(),
                                     reason="cubins not built (`make kernels`)")


def inputs(seqlens=(30, 0, 70), H=2, K=64, slots=9, pool_dtype=F32, pad=0, idx=torch.int32):
    """fwd's arguments for a varlen batch against a pool (CPU tensors)."""
    T, N = sum(seqlens), len(seqlens)
    q, k, g = (torch.randn(1, T, H, K).to(BF) for _ in range(3))
    v = torch.randn(1, T, H, K).to(BF)
    buf = torch.zeros(slots, H * K * K + pad, dtype=pool_dtype)
    pool = buf[:, :H * K * K].unflatten(-1, (H, K, K))
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()], dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=torch.randn(1, T, H).to(BF), scale=K ** -0.5,
                out=torch.empty(1, T, H, K, dtype=BF), A_log=torch.zeros(H),
                dt_bias=torch.zeros(H, K), lower_bound=-5.0, initial_state=pool,
                final_state=pool, cu_seqlens=cu,
                state_indices=torch.arange(1, N + 1, dtype=idx))


def problem(**kw):
    kw = dict(kw)
    return api.validate(kw.pop("q"), kw.pop("k"), kw.pop("v"), kw.pop("g"), kw.pop("beta"),
                        kw.pop("scale"), kw.pop("out"), kw.pop("A_log"), kw.pop("dt_bias"),
                        kw.pop("lower_bound"), kw.pop("initial_state"), kw.pop("final_state"),
                        kw.pop("cu_seqlens"), "bounded", check_seqlens=False, cuda=False, **kw)


def test_pool_problem():
    x = inputs(slots=9, pad=8, idx=torch.int64)
    wi = torch.arange(3, dtype=torch.int32).flip(0)
    p = problem(**x, output_state_indices=wi, has_initial_state=torch.ones(3, dtype=torch.bool),
                null_slot=0)
    H, K = 2, 64
    # slots, stride, read stride / int64, write given, its stride / int64, null_min, words
    assert p.pool == (9, H * K * K + 8, 1, 1, 1, 1, 0, 1, 6, 3)
    assert p.has_init and p.state_in == F32 and p.state_out == F32


def test_read_only_pool_and_dense_has_init():
    x = inputs(pool_dtype=BF)
    p = problem(**{**x, "final_state": None})
    assert p.pool[4] == 0 and p.state_out is None and p.state_in == BF
    d = inputs()
    s = torch.zeros(3, 2, 64, 64)
    p = problem(**{**d, "initial_state": s, "final_state": s, "state_indices": None},
                has_initial_state=torch.zeros(3, dtype=torch.uint8))
    assert p.pool is None and p.has_init


@pytest.mark.parametrize("change,name,what", [
    (dict(state_indices=torch.zeros(4, dtype=torch.int32)), "state_indices", "shape"),
    (dict(state_indices=torch.zeros(3, dtype=torch.int16)), "state_indices", "dtype"),
    (dict(state_indices=torch.zeros(3, 2, dtype=torch.int32)), "state_indices", "1-d"),
    (dict(output_state_indices=torch.zeros(2, dtype=torch.int32)), "output_state_indices",
     "shape"),
    (dict(initial_state=None), "initial_state", "pool"),
    (dict(final_state=torch.zeros(8, 2, 64, 64)), "final_state", "shape"),
    (dict(null_slot=1), "null_slot", "None or 0"),
    (dict(has_initial_state=torch.ones(2, dtype=torch.bool)), "has_initial_state", "3 flags"),
    (dict(has_initial_state=torch.ones(3, dtype=torch.float32)), "has_initial_state", "dtype"),
])
def test_pool_checks_name_the_argument(change, name, what):
    x = {**inputs(), **change}
    with pytest.raises((ValueError, TypeError), match=name) as e:
        problem(**x)
    assert what in str(e.value)


def test_pool_slot_stride_and_layout():
    x = inputs(pad=4)  # a slot stride that is not a multiple of 8
    with pytest.raises(ValueError, match="initial_state.*multiple of 8"):
        problem(**x)
    pool = torch.zeros(9, 64, 64, 2).permute(0, 3, 1, 2)  # [slots, H, V, K] K not contiguous
    with pytest.raises(ValueError, match="initial_state"):
        problem(**{**inputs(), "initial_state": pool, "final_state": pool})


def test_dense_form_refuses_pool_arguments():
    d = inputs()
    s = torch.zeros(3, 2, 64, 64)
    base = {**d, "initial_state": s, "final_state": s, "state_indices": None}
    for name, val in (("output_state_indices", torch.zeros(3, dtype=torch.int32)),
                      ("null_slot", 0)):
        with pytest.raises(ValueError, match=f"{name}: expected None without state_indices"):
            problem(**base, **{name: val})
    with pytest.raises(ValueError, match="has_initial_state: expected None without "
                                         "initial_state"):
        problem(**{**base, "initial_state": None}, has_initial_state=torch.ones(3).bool())
    with pytest.raises(ValueError, match="output_state_indices: expected None when no state"):
        problem(**{**d, "final_state": None}, output_state_indices=torch.zeros(3).int())


def test_a_repeated_call_rechecks_a_changed_null_slot():
    """The checks are remembered by metadata; null_slot's value is part of it."""
    x = inputs()
    problem(**x, null_slot=0)
    with pytest.raises(ValueError, match="null_slot"):
        problem(**x, null_slot=3)


def test_chunk_kda_pool_form_needs_v_first():
    x = inputs()
    with pytest.raises(ValueError, match="state_v_first"):
        api.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                      state_indices=x["state_indices"], cu_seqlens=x["cu_seqlens"])
    with pytest.raises(ValueError, match="output_state_indices"):
        api.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"],
                      output_state_indices=x["state_indices"], cu_seqlens=x["cu_seqlens"])


def _plan(spec):
    call = launch_record.make_call(spec)
    opts = launch_record._options(spec)
    p = checks.forward(Call(**{n: call.get(n) for n in Call._fields}), opts,
                       check_seqlens=False, cuda=False)
    return p, plans.plan(p, opts, plans.H200)


def _index_sources(step):
    return {n: step.source(n) for n in ("state_index", "out_index", "has_init", "index_mode",
                                        "row_div", "slots", "r_wide", "w_on", "hi_on",
                                        "null_min")}


@needs_manifests
@pytest.mark.parametrize("name", ["k128-varlen-pool", "k128-varlen-pool-int64-out-null",
                                  "k128-pool-alongside", "k128-pool-wy", "k128-pool-simt"])
def test_k2_reads_the_pool(name):
    spec = launch_record.PROBLEMS[name]
    p, pl = _plan(spec)
    k2 = pl.step("K2")
    src = _index_sources(k2)
    pool = spec["pool"]
    assert src["index_mode"] == Scalar(INDEX_POOL) and src["row_div"] == Scalar(1)
    assert src["slots"] == Scalar(pool["slots"])
    assert src["state_index"] == Role("state_indices")
    assert src["out_index"] == (Role("output_state_indices") if pool.get("out") else Errors())
    assert src["w_on"] == Scalar(int(bool(pool.get("out"))))
    assert src["r_wide"] == Scalar(int(bool(pool.get("idx64"))))
    assert src["null_min"] == Scalar(1 if pool.get("null_slot") == 0 else 0)
    assert src["has_init"] == (Role("has_initial_state") if spec.get("has_init") else Errors())
    syms = dict(k2.syms)
    assert syms["NS"] == pool["slots"] and syms["sS"] == p.pool[1]
    assert k2.source("s0f") == Role("initial_state") and k2.source("s1f") == Role("final_state")


@needs_manifests
def test_segments_read_and_write_the_pool_in_the_combine():
    spec = launch_record.PROBLEMS["k128-pool-segments-bf16"]
    p, pl = _plan(spec)
    zero, ident, comb, last = (pl.step(n) for n in ("K2 from zero", "K2 identity", "combine",
                                                     "K2 from starts"))
    for s in (zero, ident):
        assert s.source("index_mode") == Scalar(INDEX_DENSE)
        assert s.source("hi_on") == Scalar(0)
    c = _index_sources(comb)
    assert c["index_mode"] == Scalar(INDEX_POOL) and c["hi_on"] == Scalar(1)
    assert comb.source("s0h") == Role("initial_state")
    assert comb.source("final_h") == Role("final_state")
    assert comb.source("state_in") == Scalar(2) and comb.source("state_out") == Scalar(2)
    assert dict(comb.syms)["NS"] == spec["pool"]["slots"]
    # the last run: states from the combine's starts (dense), the table for padding only
    last_src = _index_sources(last)
    assert last_src["index_mode"] == Scalar(INDEX_PAD) and last_src["row_div"] == Scalar(3)
    assert last_src["state_index"] == Role("state_indices") and last_src["hi_on"] == Scalar(0)
    assert not any(type(s).__name__ == "Copy" for s in pl.steps)


@needs_manifests
def test_dense_plans_keep_the_dense_mode():
    p, pl = _plan(launch_record.PROBLEMS["k128-dense-has-init"])
    k2 = pl.step("K2")
    assert k2.source("index_mode") == Scalar(INDEX_DENSE)
    assert k2.source("has_init") == Role("has_initial_state")
    assert k2.source("state_index") == Errors()


# On the GPU: each test below is marked gpu (tests/conftest.py skips it where the kernels
# cannot run).

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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_wy_and_many_sequences_per_cta_pool():
    """The WY-form K2 (grid within one CTA per SM), then a batch whose K2 CTAs run several
    sequences each, against a pool."""
    inp, pool, buf, read, write, hi, kw = _case(128, torch.float32, torch.int64, B=1, T=200,
                                                H=64, seed=6)
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, torch.float32, ())
    inp, pool, buf, read, write, hi, kw = _case(128, torch.bfloat16, torch.int32, B=24, T=64,
                                                H=16, pad_rows=(3, 17), seed=7)
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, torch.bfloat16, (3, 17))


@pytest.mark.gpu
def test_simt_pool():
    from kda_cute.ladder import SIMT
    cfg = next(c for c in SIMT if c.prep.head_dim_k == 64)
    inp, pool, buf, read, write, hi, kw = _case(64, torch.float32, torch.int32,
                                                seqlens=[20, 1, 50], pad_rows=(1,),
                                                has_init=True, seed=8)
    _check(inp, pool, buf, pool.clone(), read, write, hi, kw, torch.float32, (1,), config=cfg)


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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
