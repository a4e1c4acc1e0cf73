"""Checkpoints on a CPU: the checks of both forms (each bad argument named), and the plans that
carry them (the checkpoints kernel, K1's and K2's side runs, K2's table) for every schedule."""

from dataclasses import replace

import pytest
import torch

from kda_cute import Call, checks, plans
from kda_cute.plans import H200, workspace
from kda_cute.plans.steps import Role, Scalar
from kda_cute.specs.checkpoints import MAX_ENTRIES
from kda_cute.specs.recur import STATE_BF16, STATE_F32

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
