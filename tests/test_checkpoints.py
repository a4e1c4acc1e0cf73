"""Prefill checkpoints. On a CPU: the checks of both forms (each bad argument named), and the
plans that carry them (the checkpoints kernel, K1's and K2's side runs, K2's table) for every
schedule. On the H200 (the tests marked gpu): each checkpoint equals the final state of a forward
of that prefix alone, bit for bit where both run the same K2 build, within 1e-5 (fp32) where the
schedules differ (alongside, segments); within the accuracy bar of float64; every destination row
or slot not asked for untouched (poisoned before each launch).

Both forms: checkpoint_offsets [N, C] into checkpoint_state [N, C, H, V, K], and checkpoint_slots
[N, M] with checkpoint_every (from checkpoint_first[n]) into a pool. Offsets cut chunks anywhere:
1, 15, 16, 17, mid-sequence, the length itself, and unused ones (-1, 0, past the length). With
checkpoint_first the rows' chunk grids shift to their first boundaries' phase: each checkpoint is
then bit-identical to its prefix alone with the same checkpoint_first, within the precision's
rounding of one without, and the forward's outputs and final state meet the float64 bar."""

from dataclasses import replace

import pytest
import torch

import kda_cute
from kda_cute import Call, checks, launch, plan, plans, run
from kda_cute.plans import H200, workspace
from kda_cute.plans.steps import Role, Scalar
from kda_cute.reference import rel_err
from kda_cute.specs.checkpoints import MAX_ENTRIES
from kda_cute.specs.recur import STATE_BF16, STATE_F32
from kda_cute.testing import SENTINEL, clear_errors, make_inputs, reference, scaled
from kda_cute.testing import bits as _bits

BF16, F32 = torch.bfloat16, torch.float32


def _call(B=1, T=300, H=4, K=128, seqlens=None, **kw):
    if seqlens is not None:
        B, T = 1, sum(seqlens)
    x = torch.empty(B, T, H, K, dtype=BF16)
    cu = None
    if seqlens is not None:
        cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist())
    return Call(x, x, x, x, torch.empty(B, T, H, dtype=BF16), torch.empty(B, T, H, K, dtype=BF16),
                torch.empty(H), torch.empty(H, K), None, None, cu, 0.1, -1.0, **kw)


def _problem(call, **opts):
    return checks.forward(call, checks.options(**opts), cuda=False)


def _offsets(N=1, C=3, H=4, K=128, dtype=F32, idx=torch.int64):
    return dict(checkpoint_state=torch.empty(N, C, H, K, K, dtype=dtype),
                checkpoint_offsets=torch.ones(N, C, dtype=idx))


def _slots(N=1, M=5, H=4, K=128, slots=16, dtype=BF16, every=64, first=False):
    kw = dict(checkpoint_state=torch.empty(slots, H, K, K, dtype=dtype),
              checkpoint_slots=torch.zeros(N, M, dtype=torch.int32), checkpoint_every=every)
    if first:
        kw["checkpoint_first"] = torch.ones(N, dtype=torch.int32)
    return kw


def test_offsets_form_metadata():
    p = _problem(_call(B=2, **_offsets(N=2, C=3)))
    ck = p.ckpt
    assert (ck.every, ck.per_row, ck.dest_rows, ck.dest_stride, ck.dtype) == (
        0, 3, 6, 4 * 128 * 128, F32)
    assert (ck.e_sn, ck.e_se, ck.e_wide, ck.e_words) == (3, 1, 1, 12)


def test_slots_form_metadata():
    p = _problem(_call(seqlens=[100, 30], **_slots(N=2, M=4, first=True)))
    ck = p.ckpt
    assert (ck.every, ck.per_row, ck.dest_rows, ck.dtype, ck.first_on) == (64, 4, 16, BF16, 1)


BAD = {
    "both forms": (dict(**_offsets(), checkpoint_slots=torch.zeros(1, 2, dtype=torch.int32)),
                   "checkpoint_offsets / checkpoint_slots"),
    "neither form": (dict(checkpoint_state=torch.empty(1, 1, 4, 128, 128)),
                     "checkpoint_offsets / checkpoint_slots"),
    "no destination": (dict(checkpoint_offsets=torch.ones(1, 2, dtype=torch.int32)),
                       "checkpoint_offsets: expected None without checkpoint_state"),
    "every with offsets": (dict(**_offsets(), checkpoint_every=64), "checkpoint_every"),
    "first with offsets": (dict(**_offsets(), checkpoint_first=torch.ones(1, dtype=torch.int32)),
                           "checkpoint_first"),
    "every not a multiple of 64": (_slots(every=48), "checkpoint_every: expected a multiple"),
    "every too large": (_slots(every=2 ** 24), "checkpoint_every: expected a multiple"),
    "every missing": (dict(_slots(), checkpoint_every=None), "checkpoint_every"),
    "every a bool": (dict(_slots(), checkpoint_every=True), "checkpoint_every"),
    "offsets float": (dict(_offsets(), checkpoint_offsets=torch.ones(1, 3)),
                      "checkpoint_offsets: expected dtype int32 or int64"),
    "offsets rows": (dict(_offsets(), checkpoint_offsets=torch.ones(2, 3, dtype=torch.int32)),
                     "checkpoint_offsets: expected shape"),
    "state shape": (dict(_offsets(), checkpoint_state=torch.empty(1, 2, 4, 128, 128)),
                    "checkpoint_state: expected shape"),
    "state dtype": (dict(_offsets(), checkpoint_state=torch.empty(1, 3, 4, 128, 128,
                                                                  dtype=torch.float16)),
                    "checkpoint_state: expected dtype"),
    "state strides": (dict(_offsets(), checkpoint_state=torch.empty(1, 3, 4, 128, 128)
                           .transpose(-1, -2)), "checkpoint_state: expected each checkpoint"),
    "too many": (_offsets(C=MAX_ENTRIES + 1, H=1, K=64), "checkpoint_offsets: expected 1 to"),
    "pool inner shape": (dict(_slots(), checkpoint_state=torch.empty(16, 4, 128, 64,
                                                                     dtype=BF16)),
                         "checkpoint_state: expected shape"),
    "first shape": (dict(_slots(first=True), checkpoint_first=torch.ones(2, dtype=torch.int32)),
                    "checkpoint_first: expected shape"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_arguments_are_named(case):
    kw, msg = BAD[case]
    K = 64 if case == "too many" else 128
    H = 1 if case == "too many" else 4
    with pytest.raises((ValueError, TypeError), match=msg.replace("(", r"\(").replace(")", r"\)")):
        _problem(_call(H=H, K=K, **kw))


def test_simt_config_has_no_checkpoints():
    from kda_cute.ladder import SIMT
    cfg = next(c for c in SIMT if c.prep.head_dim_k == 128)
    with pytest.raises(ValueError, match="config: expected a tensor-core forward"):
        _problem(_call(**_offsets()), config=cfg)


def _plan(call, **opts):
    o = checks.options(**opts)
    return plans.plan(checks.forward(call, o, cuda=False), o, H200)


@pytest.mark.parametrize("schedule,kw", [
    ("serial", dict(B=2, T=300, H=64)), ("alongside", dict(B=1, T=8192, H=32)),
    ("segments 4", dict(B=1, T=8192, H=4, segments=4)),
    ("serial", dict(seqlens=[300, 0, 1700, 5], H=64))])
def test_plans_carry_the_checkpoints(schedule, kw):
    seg = kw.pop("segments", None)
    N = 4 if "seqlens" in kw else kw["B"]
    ck = _offsets(N=N, C=3, H=kw["H"], dtype=BF16)
    plain = _plan(_call(**kw), segments=seg)
    pl = _plan(_call(**kw, **ck), segments=seg)
    assert str(pl.schedule) == schedule == str(plain.schedule)
    names = [s.name for s in pl.steps]
    assert names[names.index("checkpoints") - 1] == "zero side slots"
    # the side run last, then its rescale run (a fast forward's K2s each have one after them)
    assert names.index("K1 side") < names.index("K1") and names[-2:] == ["K2 side",
                                                                          "K2 side rescale"]
    assert [n for n in names if n.endswith(" rescale")] == [
        n + " rescale" for n in names if n.startswith("K2") and n != "K2 identity"
        and not n.endswith(" rescale")]
    # K1 a launch before K2 (not alongside): the checkpoints' preparation on the side stream
    # beside it, and every K2 after the join
    if schedule == "alongside":
        assert not [n for n in names if n.startswith(("fork", "merge", "join"))]
    else:
        f = names.index("fork: checkpoints beside K1")
        assert names[f + 1:f + 5] == ["zero side slots", "checkpoints", "K1 side", "merge: K1"]
        assert names[f + 5:f + 7] == ["K1", "join: checkpoints"]
        assert not [n for n in names[:f + 7] if n.startswith("K2")]
    # the main K1 covers the same chunks; the workspace grows by one chunk slot an entry
    assert pl.step("K1").grid == plain.step("K1").grid
    p = pl.problem
    assert workspace.rows(p, 16)[0] == workspace.rows(plain.problem, 16)[0] + 3 * N
    main = pl.step("K2 from starts" if seg else "K2")
    # the main K2 is its checkpoints build; the plain plan's is the build without
    plain_main = plain.step("K2 from starts" if seg else "K2")
    assert main.kernel.checkpoints and not plain_main.kernel.checkpoints
    assert replace(main.kernel, checkpoints=False) == plain_main.kernel
    assert main.source("ck_rows") == Scalar(4)
    assert main.source("ck_dtype") == Scalar(STATE_BF16)
    assert main.source("ck_f") == Role("checkpoint_state")
    side = pl.step("K2 side")
    assert not side.kernel.alongside and side.kernel.outputs and not side.kernel.checkpoints
    assert side.source("side") == Scalar(1) and side.source("state_in") == Scalar(STATE_F32)
    assert side.source("s1h") == Role("checkpoint_state")
    assert side.grid[:2] == main.grid[:2]
    if seg:  # the segment runs before the combine store none
        for name in ("K2 from zero", "K2 identity"):
            assert pl.step(name).source("ck_rows") == Scalar(0)
    assert pl.step("checkpoints").grid == (N, 1, 1)
    assert pl.step("K1 side").source("num_seqs") == Scalar(2 * 3 * N - 1)


def test_fp32_destination_is_its_own_scratch():
    pl = _plan(_call(B=2, T=300, H=4, **_offsets(N=2, H=4, dtype=F32)))
    assert pl.step("K2").source("ck_s") == Role("checkpoint_state")
    assert pl.step("checkpoints").source("in_place") == Scalar(1)
    pl = _plan(_call(B=2, T=300, H=4, **_offsets(N=2, H=4, dtype=BF16)))
    assert pl.step("K2").source("ck_s") != Role("checkpoint_state")
    assert pl.step("checkpoints").source("in_place") == Scalar(0)


def test_plans_without_checkpoints_store_none():
    pl = _plan(_call(B=2, T=300, H=64))
    assert pl.step("K2").source("ck_rows") == Scalar(0)
    assert not any(s.name in ("checkpoints", "K1 side", "K2 side") for s in pl.steps)


def test_every_main_k2_has_a_checkpoints_build():
    """Each K2 a forward's schedule runs as its main one (serial, WY, alongside) is built with
    checkpoints too, and the side run's is the plain build of the same config."""
    from kda_cute.ladder import ALONGSIDE, CHECKPOINT_RUNS, TENSOR_CORE, WY_RUNS, checkpoints_of
    for r in [f.recur for f in TENSOR_CORE + ALONGSIDE] + list(WY_RUNS):
        twin = checkpoints_of(r)
        assert twin is not None and twin in CHECKPOINT_RUNS and twin.name == r.name + "_ck"
    assert checkpoints_of(replace(TENSOR_CORE[0].recur, outputs=False)) is None


def test_aligned_every_form_runs_no_side():
    """checkpoint_every without checkpoint_first: every boundary ends a chunk, so the plan has
    no side slots and no side runs, only the checkpoints kernel and K2's checkpoints build."""
    call = _call(seqlens=[300, 0, 1700, 5], H=4, **_slots(N=4, M=30, dtype=F32, slots=130))
    pl = _plan(call)
    names = [s.name for s in pl.steps]
    assert "checkpoints" in names and "K2" in names
    assert not {"K1 side", "K2 side", "zero side slots"} & set(names)
    assert workspace.side_slots(pl.problem) == 0
    assert pl.step("K2").kernel.checkpoints
    with_first = _plan(_call(seqlens=[300, 0, 1700, 5], H=4,
                             **_slots(N=4, M=30, dtype=F32, slots=130, first=True)))
    assert "K2 side" not in [s.name for s in with_first.steps]
    # both say so in words
    assert ("checkpoints: 30 a sequence, every 64 tokens, on chunk boundaries (no side runs)"
            in pl.notes)
    shifted = ("checkpoints: 30 a sequence, every 64 tokens, the rows' chunk grids shifted to "
               "their first boundaries (no side runs)")
    assert shifted in with_first.notes and shifted in with_first.describe()


@pytest.mark.parametrize("kw", [dict(seqlens=[300, 0, 1700, 5], H=4),
                                dict(B=3, T=300, H=64), dict(B=1, T=8192, H=32)],
                         ids=["varlen", "fixed", "alongside"])
def test_every_form_from_first_boundaries_shifts_the_grids(kw):
    """checkpoint_first: the offsets kernel (a fixed-length batch's too, from the launcher's
    offsets) writes the shifted tables from it before K1; K1 runs each row in two (2N
    sequences: its partial first chunk, then the rest) over N more chunk slots; K2 reads
    cu_chunks as chunk0 * C + sigma (side 2) and its rescale run likewise; the checkpoints
    kernel keys from the shifted grid; no side slots, side runs or their zeroing."""
    N = len(kw["seqlens"]) if "seqlens" in kw else kw["B"]
    plain = _plan(_call(**kw))
    pl = _plan(_call(**kw, **_slots(N=N, M=30, H=kw["H"], dtype=BF16, slots=130, first=True)))
    names = [s.name for s in pl.steps]
    assert not {"K1 side", "K2 side", "K2 side rescale", "zero side slots"} & set(names)
    assert names[0] == "offsets" and names.index("offsets") < names.index("K1")
    offs, k1, k2 = pl.step("offsets"), pl.step("K1"), pl.step("K2")
    assert offs.source("shifted") == Scalar(1)
    assert offs.source("first") == Role("checkpoint_first")
    if "seqlens" not in kw:  # the launcher's offsets of the fixed-length rows
        assert offs.source("cu_in").buffer.kind == "segments"
    assert k1.source("cu_seqlens") == offs.source("k1_cu_seqlens")
    assert k1.source("cu_chunks") == offs.source("k1_cu_chunks")
    assert k1.source("num_seqs") == Scalar(2 * N) and k1.source("seq_len") == Scalar(0)
    assert dict(k1.syms)["N1"] == 2 * N + 1
    assert k2.source("cu_chunks") == offs.source("cu_chunks")
    assert k2.source("cu_seqlens") == offs.source("cu_seqlens")
    assert k2.source("side") == Scalar(2) and k2.kernel.checkpoints
    assert pl.step("K2 rescale").source("side") == Scalar(2)
    assert pl.step("checkpoints").source("shifted") == Scalar(1)
    p = pl.problem
    assert workspace.main_slots(p, 16) == workspace.main_slots(plain.problem, 16) + N
    assert workspace.side_slots(p) == (0 if "seqlens" in kw else N * 30)
    assert workspace.rows(p, 16)[0] * 16 <= pl.workspace_bytes
    # the K1 grid covers the slots
    assert k1.grid[1] * k1.grid[2] >= workspace.main_slots(p, 16)


def test_segments_keep_the_side_runs_with_first_boundaries():
    """The segments do not shift: a fixed-length batch that runs in segments takes the side
    runs for mid-chunk boundaries, in the side slots its workspace keeps."""
    ck = _slots(N=1, M=30, H=4, dtype=BF16, slots=130, first=True)
    pl = _plan(_call(B=1, T=8192, H=4, **ck), segments=4)
    assert str(pl.schedule) == "segments 4"
    names = [s.name for s in pl.steps]
    assert {"K1 side", "K2 side", "zero side slots"} <= set(names)
    assert "offsets" not in names
    assert pl.step("checkpoints").source("shifted") == Scalar(0)
    assert pl.step("K2 from starts").source("side") == Scalar(0)


@pytest.mark.parametrize("seed", range(6))
def test_shifted_tables_tile_every_row(seed):
    """workspace.shifted_tables (the offsets kernel's reference): K1's two pieces of each row
    tile it, the first no longer than the chunk; K2's chunk j of row n, [vs + jC, vs + (j+1)C)
    cut to the row (vs = bos - sigma), is K1's chunk in the same slot; every boundary first[n]
    + i * 64 ends a chunk; the rows' slots do not overlap and stay below the bound (the last
    cu_chunks entry) and the workspace's main slots."""
    from kda_cute.plans.workspace import shifted_tables
    g = torch.Generator().manual_seed(seed)
    C = 16
    N = int(torch.randint(1, 40, (1,), generator=g))
    lens = torch.randint(0, 300, (N,), generator=g)
    lens[torch.rand(N, generator=g) < 0.2] = 0
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    first = torch.randint(-200, 400, (N,), generator=g)
    cu1, cc1, cc2 = (t.long() for t in shifted_tables(cu, first, C))
    T = int(cu[-1])
    bound = int(cc1[-1])
    assert bound == T // C + 2 * N and int(cc2[-1]) == bound * C
    assert bool((cc1[1:] > cc1[:-1]).all())
    # K1's chunks: slot -> tokens
    k1 = {}
    for s in range(2 * N):
        a, b, c0 = int(cu1[s]), int(cu1[s + 1]), int(cc1[s])
        for j, t in enumerate(range(a, b, C)):
            assert c0 + j < int(cc1[s + 1]) and c0 + j < bound
            k1[c0 + j] = (t, min(C, b - t))
    for n in range(N):
        bos, eos = int(cu[n]), int(cu[n + 1])
        assert int(cu1[2 * n]) == bos and bos <= int(cu1[2 * n + 1]) <= min(eos, bos + C - 1)
        chunk0, sigma = int(cc2[n]) // C, int(cc2[n]) % C
        vs = bos - sigma
        nch = (eos - vs + C - 1) // C if eos > bos else 0
        assert (sigma == 0) if eos == bos else sigma == (-int(first[n])) % C
        ends = set()
        for j in range(nch):
            a = vs + j * C
            t0 = max(bos, a)
            length = min(a + C, eos) - t0
            assert length >= 1 and k1[chunk0 + j] == (t0, length), (n, j)
            ends.add(t0 + length - bos)
        for i in range(10):
            o = int(first[n]) + 64 * i
            if 1 <= o <= eos - bos:
                assert o in ends, (n, o)
        # (o + sigma) / C chunks before the boundary, as the checkpoints kernel keys it
        assert all((o + sigma) % C == 0 or o == eos - bos for o in ends)


def test_checkpoint_state_must_be_aligned():
    buf = torch.empty(1 * 3 * 4 * 128 * 128 + 1)
    cs = buf[1:].view(1, 3, 4, 128, 128)  # 4 bytes past an aligned base
    with pytest.raises(ValueError, match="checkpoint_state: expected a 16-byte aligned base"):
        _problem(_call(checkpoint_state=cs,
                       checkpoint_offsets=torch.ones(1, 3, dtype=torch.int32)))


# On the GPU: each test below is marked gpu (tests/conftest.py skips it where the kernels
# cannot run).

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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
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


@pytest.mark.gpu
def test_checkpoints_with_large_values():
    """Checkpoints (both forms: offsets cutting chunks, and every 64 from a mid-chunk first
    boundary) of a forward whose values overflow fp16: each within the bar of the float64 state
    of its prefix, and bit-identical to the final state of that prefix's own forward (which
    takes the same rescale run)."""
    inp = scaled(make_inputs(seqlens=[300, 130], H=2, K=128, seed=75))
    offs = torch.tensor([[64, 100, 300, -1], [17, 128, 1, 130]], device="cuda")
    cs = torch.full((2, 4, 2, 128, 128), SENTINEL, device="cuda")
    out = torch.empty_like(inp["v"])
    opts = _opts(inp, **SERIAL)
    call = Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out, inp["A_log"],
                inp["dt_bias"], inp["initial_state"], None, inp["cu_seqlens"], inp["scale"],
                inp["lower_bound"], checkpoint_state=cs, checkpoint_offsets=offs)
    clear_errors()
    run(plan(checks.forward(call, opts), opts, plans.device_info(0)), call)
    torch.cuda.synchronize()
    kda_cute.check_errors(sync=True)
    _check_offsets(inp, offs, cs, inp["initial_state"], opts, opts)
