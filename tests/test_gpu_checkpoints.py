"""Prefill checkpoints on the H200 (skips without a Hopper GPU + cubins): each checkpoint equals
the final state of a forward of that prefix alone, bit for bit where both run the same K2 build,
within 1e-5 (fp32) where the schedules differ (alongside, segments); within the accuracy bar of
float64; every destination row or slot not asked for untouched (poisoned before each launch).

Both forms: checkpoint_offsets [N, C] into checkpoint_state [N, C, H, V, K], and checkpoint_slots
[N, M] with checkpoint_every (from checkpoint_first[n]) into a pool. Offsets cut chunks anywhere:
1, 15, 16, 17, mid-sequence, the length itself, and unused ones (-1, 0, past the length). With
checkpoint_first the rows' chunk grids shift to their first boundaries' phase: each checkpoint is
then bit-identical to its prefix alone with the same checkpoint_first, within the precision's
rounding of one without, and the forward's outputs and final state meet the float64 bar."""

import pytest
import torch

import kda_cute
from kda_cute import Call, checks, launch, plans
from kda_cute.reference import rel_err
from kda_cute.testing import SENTINEL, make_inputs, reference
from kda_cute.testing import bits as _bits

pytestmark = pytest.mark.gpu

STATE_TOL = {torch.float32: 2.5e-3, torch.bfloat16: 6e-3}
# the schedules' K2 builds: plain serial, WY everywhere it is built
SERIAL = dict(alongside=False, wy="off", segments=1)
WY = dict(alongside=False, wy="force", segments=1)


def _opts(inp, precision="fast", **kw):
    return checks.options(gate=inp["gate"], precision=precision, **kw)


def _run(inp, out, s0, s1, opts, cu=None, rows=None, ws=None, **kw):
    """The forward with explicit options (schedules chosen by the test); rows: a token slice;
    ws: a caller workspace."""
    q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
    if rows is not None:
        q, k, v, g, beta = (x[:, rows] for x in (q, k, v, g, beta))
    call = Call(q, k, v, g, beta, out, inp["A_log"], inp["dt_bias"], s0, s1, cu, inp["scale"],
                inp["lower_bound"], **kw)
    p = checks.forward(call, opts)
    pl = plans.plan(p, opts, plans.device_info(q.device))
    launch.run(pl, call, ws)
    return pl


def _bounds(inp):
    cu, N, T = inp["cu_seqlens"], inp["N"], inp["q"].shape[1]
    if cu is not None:
        return [(int(cu[n]), int(cu[n + 1])) for n in range(N)]
    return [(n * T, (n + 1) * T) for n in range(N)]


def _shifted_by(first, H, V, K):
    """A forward's checkpoint arguments that ask for nothing but shift its one row's grid as
    checkpoint_first = first does (every slot -1)."""
    return dict(checkpoint_state=torch.empty(1, H, V, K, device="cuda"),
                checkpoint_slots=torch.full((1, 1), -1, dtype=torch.int32, device="cuda"),
                checkpoint_every=64,
                checkpoint_first=torch.tensor([first], dtype=torch.int32, device="cuda"))


def _prefix(inp, n, o, s0, dtype, opts, first=None):
    """The final state of a forward of sequence n's first o tokens alone, from s0; its grid
    shifted as checkpoint_first = `first` shifts it, if given."""
    b, _ = _bounds(inp)[n]
    flat = {x: inp[x].flatten(0, 1)[None] for x in ("q", "k", "v", "g", "beta")}
    sub = dict(inp, **flat)
    H, V, K = inp["v"].shape[2], inp["v"].shape[3], inp["q"].shape[3]
    out = torch.empty(1, o, H, V, dtype=torch.bfloat16, device="cuda")
    final = torch.full((1, H, V, K), float("nan"), dtype=dtype, device="cuda")
    kw = {} if first is None else _shifted_by(first, H, V, K)
    _run(sub, out, None if s0 is None else s0[None].clone(), final, opts,
         rows=slice(b, b + o), **kw)
    return final[0]


def _ref_state(inp, n, o, s0):
    b, _ = _bounds(inp)[n]
    flat = {x: inp[x].flatten(0, 1)[None, b:b + o] for x in ("q", "k", "v", "g", "beta")}
    sub = dict(inp, **flat, cu_seqlens=None,
               initial_state=None if s0 is None else s0[None].float())
    return reference(sub)[1][0]


def _same(a, b):
    return torch.equal(_bits(a), _bits(b))


def _close(a, b, tol=1e-5):
    return float((a.float() - b.float()).abs().max()) <= tol * float(b.float().abs().max())


OFFSETS = [1, 15, 16, 17, 100, 255, 256, 299, 300, -1, 0, 301, 17]


def _offsets_case(inp, C, seed):
    """checkpoint_offsets [N, C]: every row a mix of chunk cuts, its length and unused ones."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b, e in _bounds(inp):
        L = e - b
        pool = [o for o in OFFSETS if o <= L] + [L, L + 1, -1, max(1, L // 2), max(1, L - 5)]
        rows.append([pool[int(i)] for i in torch.randint(len(pool), (C,), generator=gen)])
    return torch.tensor(rows, dtype=torch.int64, device="cuda")


def _check_offsets(inp, offs, cs, s0, opts, prefix_opts, exact=True):
    """Every used checkpoint against the prefix alone (and float64); unused rows untouched."""
    dtype = cs.dtype
    for n, (b, e) in enumerate(_bounds(inp)):
        for c in range(offs.shape[1]):
            o = int(offs[n, c])
            if not 1 <= o <= e - b:
                assert bool((_bits(cs[n, c]) == _bits(torch.full_like(cs[n, c], SENTINEL))
                             ).all()), f"unused checkpoint ({n}, {c}) written"
                continue
            want = _prefix(inp, n, o, None if s0 is None else s0[n], dtype, prefix_opts)
            got = cs[n, c]
            assert not bool(torch.isnan(got.float()).any()), (n, c, o)
            if exact:
                assert _same(got, want), (n, c, o, float((got.float() - want.float()).abs()
                                                         .max()))
            else:
                assert _close(got, want), (n, c, o)
            ref = _ref_state(inp, n, o, None if s0 is None else s0[n])
            assert rel_err(got, ref) < STATE_TOL[dtype], (n, c, o)


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("precision", ["fast", "precise"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_offsets_fixed_length(K, precision, dtype):
    inp = make_inputs(B=2, T=300, H=2, K=K, seed=K + 7)
    offs = _offsets_case(inp, 6, K)
    H = 2
    cs = torch.full((2, 6, H, K, K), SENTINEL, dtype=dtype, device="cuda")
    out = torch.empty_like(inp["v"])
    final = torch.empty(2, H, K, K, device="cuda")
    opts = _opts(inp, precision, **SERIAL)
    _run(inp, out, inp["initial_state"], final, opts, checkpoint_state=cs,
         checkpoint_offsets=offs)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    _check_offsets(inp, offs, cs, inp["initial_state"], opts, opts)
    # the forward itself unchanged by its checkpoints
    out2, final2 = torch.empty_like(out), torch.empty_like(final)
    _run(inp, out2, inp["initial_state"], final2, opts)
    torch.cuda.synchronize()
    assert _same(out, out2) and _same(final, final2)


@pytest.mark.parametrize("K", [64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("wy", ["off", "force"])
def test_offsets_varlen_int32(K, dtype, wy):
    inp = make_inputs(seqlens=[37, 0, 130, 1, 64, 300], H=2, K=K, seed=K)
    offs = _offsets_case(inp, 4, K + 1).to(torch.int32)
    cs = torch.full((6, 4, 2, K, K), SENTINEL, dtype=dtype, device="cuda")
    out = torch.empty_like(inp["v"])
    opts = _opts(inp, **dict(SERIAL, wy=wy))
    _run(inp, out, inp["initial_state"], None, opts, cu=inp["cu_seqlens"],
         checkpoint_state=cs, checkpoint_offsets=offs)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    _check_offsets(inp, offs, cs, inp["initial_state"], opts, opts)


def _pool_case(inp, dtype, slots, pad_rows=()):
    N, H, V, K = inp["N"], inp["v"].shape[2], inp["v"].shape[3], inp["q"].shape[3]
    pool = torch.full((slots, H, V, K), SENTINEL, dtype=dtype, device="cuda")
    read = torch.arange(N, device="cuda") * 3 + 1
    pool[read] = inp["initial_state"].to(dtype)
    for n in pad_rows:
        read[n] = -1
    return pool, read


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("precision", ["fast", "precise"])
@pytest.mark.parametrize("with_first", [True, False], ids=["first", "aligned"])
def test_every_into_pool(dtype, precision, with_first):
    """Form (b): a state every 64 tokens from each row's first boundary (64, a mid-chunk one,
    1, past the row; or the default, 64: every one on a chunk boundary, no side runs) into the
    pool the forward reads and writes; -1 slots skipped; a padding row writes none."""
    seqlens = [200, 0, 130, 300, 64, 90]
    inp = make_inputs(seqlens=seqlens, H=2, K=128, seed=3)
    N, M = len(seqlens), 5
    pool, read = _pool_case(inp, dtype, 64, pad_rows=(5,))
    first = torch.tensor([64, 30, 1, 17, 64, 10], dtype=torch.int32, device="cuda")
    if not with_first:
        first.fill_(64)
    slots = torch.arange(N * M, device="cuda").view(N, M) + 24
    slots[0, 1] = -1
    slots = slots.to(torch.int64)
    before = pool.clone()
    out = torch.empty_like(inp["v"])
    opts = _opts(inp, precision, **SERIAL)
    _run(inp, out, pool, pool, opts, cu=inp["cu_seqlens"], state_indices=read,
         checkpoint_state=pool, checkpoint_slots=slots, checkpoint_every=64,
         checkpoint_first=first if with_first else None)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    written = set()
    for n, (b, e) in enumerate(_bounds(inp)):
        if n != 5:
            written.add(int(read[n]))
        for i in range(M):
            o = int(first[n]) + 64 * i
            s = int(slots[n, i])
            if n == 5 or s < 0 or not 1 <= o <= e - b:
                continue
            written.add(s)
            f = int(first[n]) if with_first else None
            want = _prefix(inp, n, o, before[read[n]], dtype, opts, first=f)
            assert _same(pool[s], want), (n, i, o)
            if f is not None:  # the unshifted grid: the precision's rounding apart
                other = _prefix(inp, n, o, before[read[n]], dtype, opts)
                assert rel_err(pool[s], other) < STATE_TOL[dtype], (n, i, o)
            assert rel_err(pool[s], _ref_state(inp, n, o, before[read[n]])) < STATE_TOL[dtype]
    rest = [s for s in range(pool.shape[0]) if s not in written]
    assert _same(pool[rest], before[rest])


@pytest.mark.parametrize("K", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_every_into_a_strided_pool(K, dtype):
    """Form (b) into a pool whose slot stride is not H V K (a view of wider rows, the gaps
    poisoned): the checkpoints' tensor maps (K <= 128) and row copies (K = 256) write each slot
    where the pool's stride puts it, bit-identical to the prefix alone, and nothing else of the
    buffer (mid-chunk boundaries too: the scratch rows take the same stride)."""
    seqlens = [200, 130, 300]
    inp = make_inputs(seqlens=seqlens, H=2, K=K, seed=11)
    N, M, H, V = len(seqlens), 4, 2, K
    slots, pad = 16, 24
    big = torch.full((slots, H * V * K + pad), SENTINEL, dtype=dtype, device="cuda")
    pool = big[:, :H * V * K].view(slots, H, V, K)
    first = torch.tensor([64, 30, 17], dtype=torch.int32, device="cuda")
    cs = (torch.arange(N * M, device="cuda").view(N, M) + 3).to(torch.int32)
    before = big.clone()
    out = torch.empty_like(inp["v"])
    opts = _opts(inp, **SERIAL)
    _run(inp, out, None, None, opts, cu=inp["cu_seqlens"], checkpoint_state=pool,
         checkpoint_slots=cs, checkpoint_every=64, checkpoint_first=first)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    written = set()
    for n, (b, e) in enumerate(_bounds(inp)):
        for i in range(M):
            o, s = int(first[n]) + 64 * i, int(cs[n, i])
            if not 1 <= o <= e - b:
                continue
            written.add(s)
            want = _prefix(inp, n, o, None, dtype, opts, first=int(first[n]))
            assert _same(pool[s], want), (n, i, o)
    assert written
    rest = [s for s in range(slots) if s not in written]
    assert _same(big[rest], before[rest])
    assert _same(big[:, H * V * K:], before[:, H * V * K:])  # the gaps between slots


@pytest.mark.parametrize("form", ["every", "offsets"])
@pytest.mark.parametrize("K,precision,dtype,H", [(128, "fast", torch.bfloat16, 48),
                                                   (64, "precise", torch.float32, 96)])
def test_many_heads_and_mid_chunk_boundaries(K, precision, dtype, H, form):
    """Many heads, many boundaries inside the rows' chunks (some past a row's end or skipped
    among them). The every-n form from first boundaries: no side run (the grids shifted),
    every checkpoint bit-identical to its prefix alone with the same checkpoint_first. The
    same boundaries as offsets: side slots, K1's side run looped (a CTA several side slots
    in turn), every checkpoint bit-identical to its prefix alone. Every other slot untouched."""
    seqlens = [700, 300, 520]
    inp = make_inputs(seqlens=seqlens, H=H, K=K, seed=17)
    N, M = len(seqlens), 11
    first = torch.tensor([30, 17, 40], dtype=torch.int32, device="cuda")
    cs = (torch.arange(N * M, device="cuda").view(N, M)).to(torch.int32)
    cs[1, 2] = -1
    pool = torch.full((N * M, H, K, K), SENTINEL, dtype=dtype, device="cuda")
    before = pool.clone()
    out = torch.empty_like(inp["v"])
    opts = _opts(inp, precision, **SERIAL)
    if form == "every":
        kw = dict(checkpoint_state=pool, checkpoint_slots=cs, checkpoint_every=64,
                  checkpoint_first=first)
    else:  # row n's entry i at row n * M + i of [N, M, H, V, K]
        offs = _every_64_from(first, M)
        offs[cs < 0] = -1
        kw = dict(checkpoint_state=pool.view(N, M, H, K, K), checkpoint_offsets=offs)
    pl = _run(inp, out, None, None, opts, cu=inp["cu_seqlens"], **kw)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    names = [s.name for s in pl.steps]
    if form == "every":
        assert not {"K1 side", "K2 side"} & set(names), names
    else:
        # K1's side run, looped: fewer grid rows (one resident wave over H heads) than the 23
        # side slots in use, so some CTAs prepare two partial chunks in turn
        side = pl.step("K1 side")
        assert side.kernel.looped and side.grid[0] == H and side.grid[1] < 23, side.grid
    written = set()
    for n, (b, e) in enumerate(_bounds(inp)):
        for i in range(M):
            o, s = int(first[n]) + 64 * i, int(cs[n, i])
            if s < 0 or not 1 <= o <= e - b:
                continue
            written.add(s)
            f = int(first[n]) if form == "every" else None
            assert _same(pool[s], _prefix(inp, n, o, None, dtype, opts, first=f)), (n, i, o)
    assert len(written) == 11 + 4 + 8
    for n, i in ((0, 0), (0, 10), (2, 7)):  # and within the bar of float64
        o = int(first[n]) + 64 * i
        assert rel_err(pool[int(cs[n, i])], _ref_state(inp, n, o, None)) < STATE_TOL[dtype]
    rest = [s for s in range(N * M) if s not in written]
    assert _same(pool[rest], before[rest])


@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "fixed"])
def test_shifted_tables_on_the_device(varlen):
    """The offsets kernel's shifted tables equal workspace.shifted_tables: more rows than its
    threads (a loop), empty rows, first boundaries of every phase (negative, past the row)
    as a strided int64 view; a fixed-length batch's from the launcher's offsets."""
    from kda_cute.launch import buffers
    from kda_cute.plans.workspace import shifted_tables

    # (the launcher's scratch cache emptied: a full one is emptied while a plan's sources are
    # resolved, and buffers.get would then hand this test a new tensor, not the one written)
    kda_cute.clear_caches()
    gen = torch.Generator().manual_seed(9)
    if varlen:
        lens = torch.randint(0, 40, (300,), generator=gen)
        lens[::7] = 0
        inp = make_inputs(seqlens=lens.tolist(), H=2, K=64, seed=3)
        cu = inp["cu_seqlens"]
    else:
        inp = make_inputs(B=5, T=77, H=2, K=64, seed=3)
        cu = torch.arange(6, device="cuda") * 77
    N = cu.numel() - 1
    first = torch.randint(-100, 300, (N, 2), generator=gen).cuda()[:, 1]
    out = torch.empty_like(inp["v"])
    call = Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, inp["A_log"],
                inp["dt_bias"], None, None, inp["cu_seqlens"], inp["scale"],
                inp["lower_bound"], checkpoint_state=torch.empty(4, 2, 64, 64, device="cuda"),
                checkpoint_slots=torch.full((N, 2), -1, dtype=torch.int32, device="cuda"),
                checkpoint_every=64, checkpoint_first=first)
    opts = _opts(inp, **SERIAL)
    pl = plans.plan(checks.forward(call, opts), opts, plans.device_info(0))
    offs = pl.step("offsets")
    launch.run(pl.only("offsets"), call)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    stream = torch.cuda.current_stream().cuda_stream
    got = [buffers.get(offs.source(name).buffer, out.device, stream).cpu()
           for name in ("k1_cu_seqlens", "k1_cu_chunks", "cu_chunks", "cu_seqlens")]
    want = shifted_tables(cu, first, pl.config.chunk)
    for name, g, w in zip(("k1 cu_seqlens", "k1 cu_chunks", "cu_chunks"), got, want,
                          strict=False):
        assert torch.equal(g, w), name
    assert torch.equal(got[3].long(), cu.cpu().long())


OUT_TOL = 3.5e-3


@pytest.mark.parametrize("sched", ["serial", "wy", "alongside"])
@pytest.mark.parametrize("K", [64, 128, 256])
def test_shifted_forward_meets_the_reference(K, sched):
    """A forward whose grids are shifted (every-n checkpoints from first boundaries with every
    phase: 0, 1, 15, 16, past a short row, negative, int64 and strided): its outputs (the
    partial first chunks' stored token by token) and final states within the float64 bar,
    the output buffer's guard rows untouched; within the precision's rounding of the forward
    without checkpoints (a different grid)."""
    if sched == "alongside":
        seqlens = [2048, 1000]
        opts_kw = dict(segments=1, alongside=True, wy="off")
    else:
        seqlens = [200, 0, 7, 130, 64, 301, 33, 16]
        opts_kw = SERIAL if sched == "serial" else WY
    inp = make_inputs(seqlens=seqlens, H=2, K=K, seed=K + 3)
    N = len(seqlens)
    phases = [5, 1, 15, 16, 64, 40, -3, 0]
    wide = torch.tensor(phases[:N], dtype=torch.int64, device="cuda")
    first = torch.stack([wide, wide], 1)[:, 0]  # (a strided int64 view)
    M, H = 8, 2
    pool = torch.full((N * M, H, K, K), SENTINEL, device="cuda")
    slots = torch.arange(N * M, dtype=torch.int32, device="cuda").view(N, M)
    pad = 32
    T = inp["q"].shape[1]
    buf = torch.full((T + 2 * pad, H, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buf[pad:pad + T].unsqueeze(0)
    final = torch.full((N, H, K, K), float("nan"), device="cuda")
    opts = _opts(inp, **opts_kw)
    pl = _run(inp, out, inp["initial_state"], final, opts, cu=inp["cu_seqlens"],
              checkpoint_state=pool, checkpoint_slots=slots, checkpoint_every=64,
              checkpoint_first=first)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    assert pl.step("K2").source("side").value == 2
    assert str(pl.schedule) == ("alongside" if sched == "alongside" else "serial")
    ref_o, ref_s = reference(inp)
    assert torch.isfinite(out.float()).all() and torch.isfinite(final).all()
    assert rel_err(out, ref_o) < OUT_TOL and rel_err(final, ref_s) < STATE_TOL[torch.float32]
    assert bool(torch.isnan(buf[:pad].float()).all() and torch.isnan(buf[-pad:].float()).all())
    out2, final2 = torch.empty_like(out), torch.empty_like(final)
    _run(inp, out2, inp["initial_state"], final2, opts, cu=inp["cu_seqlens"])
    torch.cuda.synchronize()
    assert rel_err(final, final2) < STATE_TOL[torch.float32] and rel_err(out, out2) < OUT_TOL


def test_every_bad_slot_raises():
    inp = make_inputs(seqlens=[130, 70], H=2, K=64, seed=5)
    pool, read = _pool_case(inp, torch.float32, 16)
    slots = torch.tensor([[9, 10], [99, 11]], dtype=torch.int32, device="cuda")
    before = pool.clone()
    out = torch.empty_like(inp["v"])
    kda_cute.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out,
                 inp["A_log"], inp["dt_bias"], inp["lower_bound"], pool, pool,
                 inp["cu_seqlens"], state_indices=read, checkpoint_state=pool,
                 checkpoint_slots=slots, checkpoint_every=64)
    with pytest.raises(kda_cute.DeviceValueError, match="checkpoint_slots"):
        kda_cute.check_errors(sync=True)
    # the good ones written (row 0 at 64 and 128; row 1's 128 is past its length), nothing
    # past the pool followed, the rest untouched
    assert not _same(pool[9], before[9]) and not _same(pool[10], before[10])
    untouched = [s for s in range(16) if s not in (1, 4, 9, 10)]
    assert _same(pool[untouched], before[untouched])


@pytest.mark.parametrize("K", [128, 256])
def test_offsets_segments_and_alongside(K):
    """Schedules whose prefix runs differ: segments (B1, few heads) and alongside: within 1e-5
    of the prefix alone (fp32)."""
    inp = make_inputs(B=1, T=2048, H=1, K=K, seed=11)
    offs = torch.tensor([[17, 512, 1000, 1024, 2047, 2048, 33, 1537]], device="cuda")
    for kw in (dict(segments=4, alongside=False, wy="off"),
               dict(segments=1, alongside=True, wy="off")):
        cs = torch.full((1, 8, 1, K, K), SENTINEL, device="cuda")
        out = torch.empty_like(inp["v"])
        opts = _opts(inp, **kw)
        pl = plans.plan(checks.forward(Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"],
                                            out, inp["A_log"], inp["dt_bias"],
                                            inp["initial_state"], None, None, inp["scale"],
                                            inp["lower_bound"], checkpoint_state=cs,
                                            checkpoint_offsets=offs), opts),
                        opts, plans.device_info(0))
        assert str(pl.schedule) == ("segments 4" if kw["segments"] == 4 else "alongside")
        _run(inp, out, inp["initial_state"], None, opts, checkpoint_state=cs,
             checkpoint_offsets=offs)
        torch.cuda.synchronize()
        _check_offsets(inp, offs, cs, inp["initial_state"], opts, _opts(inp, **SERIAL),
                       exact=False)


def test_checkpoints_in_a_cuda_graph():
    """Captured once, replayed with new offsets and new inputs: the checkpoints follow."""
    inp = make_inputs(seqlens=[100, 260], H=2, K=128, seed=21)
    offs = torch.tensor([[16, 50], [1, 259]], dtype=torch.int32, device="cuda")
    cs = torch.full((2, 2, 2, 128, 128), SENTINEL, device="cuda")
    out = torch.empty_like(inp["v"])
    opts = _opts(inp, **SERIAL)
    kw = dict(cu=inp["cu_seqlens"], checkpoint_state=cs, checkpoint_offsets=offs)
    pl = _run(inp, out, inp["initial_state"], None, opts, **kw)
    ws = torch.empty(pl.workspace_bytes, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _run(inp, out, inp["initial_state"], None, opts, ws=ws, **kw)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _run(inp, out, inp["initial_state"], None, opts, ws=ws, **kw)
    offs.copy_(torch.tensor([[99, 100], [17, 128]], device="cuda"))
    cs.fill_(SENTINEL)
    graph.replay()
    torch.cuda.synchronize()
    _check_offsets(inp, offs, cs, inp["initial_state"], opts, opts)


def _every_64_from(first: torch.Tensor, M: int) -> torch.Tensor:
    """The every-64 boundaries from first as checkpoint_offsets [N, M] (int32)."""
    return first[:, None] + 64 * torch.arange(M, device=first.device, dtype=torch.int32)[None]


def _scratch_case(seed=29, varlen=True, form="every"):
    """A forward (varlen, or fixed-length: its offsets the launcher's constants) with
    checkpoints every 64 tokens from mid-chunk first boundaries (the grids shifted, the
    launcher's checkpoint and shifted tables in use), or at the same offsets (every side run
    in use), and the bf16 pool it writes."""
    if varlen:
        inp = make_inputs(seqlens=[300, 17, 700, 450], H=4, K=128, seed=seed)
    else:
        inp = make_inputs(B=4, T=450, H=4, K=128, seed=seed)
    N, M = 4, 12
    first = torch.tensor([30, 5, 64, 41], dtype=torch.int32, device="cuda")
    slots = torch.arange(N * M, device="cuda", dtype=torch.int32).view(N, M)
    pool = torch.full((N * M, 4, 128, 128), SENTINEL, dtype=torch.bfloat16, device="cuda")
    out = torch.full_like(inp["v"], float("nan"))
    final = torch.full_like(inp["initial_state"], float("nan"), dtype=torch.float32)
    kw = dict(cu=inp["cu_seqlens"] if varlen else None, checkpoint_state=pool,
              checkpoint_slots=slots,
              checkpoint_every=64, checkpoint_first=first)
    if form == "offsets":
        offs = _every_64_from(first, M)
        kw = dict(cu=kw["cu"], checkpoint_state=pool.view(N, M, 4, 128, 128),
                  checkpoint_offsets=offs)
    return inp, out, final, pool, kw


def _junk(t: torch.Tensor, byte: int) -> None:
    t.view(torch.uint8).fill_(byte)


@pytest.mark.parametrize("form", ["every", "offsets"])
@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "fixed"])
def test_the_launchers_scratch_is_written_before_it_is_read(varlen, form):
    """Every scratch tensor the launcher keeps for a checkpointed forward (its tables, side
    slots, scratch states, rescale words, offsets, shifted tables) filled with junk between
    two calls: the second call's outputs are bit-identical to the first's and no error is
    reported (each forward writes what it reads of them)."""
    from kda_cute.launch import buffers
    from kda_cute.plans.steps import At

    inp, out, final, pool, kw = _scratch_case(varlen=varlen, form=form)
    opts = _opts(inp, **SERIAL)
    pl = _run(inp, out, inp["initial_state"], final, opts, **kw)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    want = [x.clone() for x in (out, final, pool)]
    stream = torch.cuda.current_stream().cuda_stream
    made = {x.buffer for s in pl.launches() for x in s.sources
            if isinstance(x, At) and x.buffer.kind == "scratch"}
    uses = {b.params[0] for b in made}
    assert "checkpoints" in uses and (not varlen or "cu_seqlens" in uses), uses
    if form == "every":
        assert {"k1 cu_seqlens", "k1 cu_chunks", "cu_chunks"} <= uses, uses
    for byte in (0xFF, 0x7F, 0x41):
        for b in made:
            _junk(buffers.get(b, out.device, stream), byte)
        for x in (out, final):
            x.fill_(float("nan"))
        pool.fill_(SENTINEL)
        _run(inp, out, inp["initial_state"], final, opts, **kw)
        torch.cuda.synchronize()
        kda_cute.check_errors(sync=True)
        for got, w in zip((out, final, pool), want, strict=True):
            assert _same(got, w), byte


@pytest.mark.parametrize("form", ["every", "offsets"])
@pytest.mark.parametrize("varlen", [True, False], ids=["varlen", "fixed"])
def test_a_graph_outlives_the_launchers_caches(varlen, form):
    """A forward run eagerly on a stream, then captured on it: the launcher's caches emptied
    (kda_cute.clear_caches) and the memory they freed taken by junk-filled tensors of the same
    sizes on that stream; the graph's replay still gives the eager call's outputs bit for bit
    (its scratch is its own, from the capture's pool; the constants it reads pinned)."""
    import gc

    from kda_cute.plans.steps import At

    inp, out, final, pool, kw = _scratch_case(seed=31, varlen=varlen, form=form)
    opts = _opts(inp, **SERIAL)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pl = _run(inp, out, inp["initial_state"], final, opts, **kw)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    want = [x.clone() for x in (out, final, pool)]
    sizes = list({x.buffer for st in pl.launches() for x in st.sources if isinstance(x, At)})
    kinds = {b.kind for b in sizes}
    assert "scratch" in kinds and (varlen or "segments" in kinds), kinds
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=s):
        _run(inp, out, inp["initial_state"], final, opts, **kw)
    kda_cute.clear_caches()
    gc.collect()
    junk = []
    with torch.cuda.stream(s):
        for b in sizes * 3:
            t = torch.empty(b.shape, dtype=b.dtype, device="cuda")
            _junk(t, 0x7F)
            junk.append(t)
    torch.cuda.synchronize()
    for x in (out, final):
        x.fill_(float("nan"))
    pool.fill_(SENTINEL)
    with torch.cuda.stream(s):
        graph.replay()
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    for got, w in zip((out, final, pool), want, strict=True):
        assert _same(got, w)
    del junk
