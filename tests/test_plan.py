"""What a forward launches, asserted on its plan (kda_cute.plans): the steps, their kernels, grids,
blocks, shared memory and programmatic flags, where each argument comes from, the schedule and
the workspace layout. Plans are pure metadata: no driver, no device, no tensor memory (CPU only).
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import kda_cute
from kda_cute import api, checks, ladder, launch, plans
from kda_cute.ladder import (
    OFFSETS,
    TENSOR_CORE,
    WY_RUNS,
    alongside_of,
    checkpoints_of,
    combine_config,
    rescale_of,
    select_config,
    wy_of,
)
from kda_cute.launch import driver
from kda_cute.plans import schedule, workspace
from kda_cute.plans.device import Resources, resident, resident_per_sm, resources, smem_unit
from kda_cute.plans.steps import (
    At,
    Buffer,
    CallScalar,
    Copy,
    Errors,
    Launch,
    Memset,
    Plane,
    Role,
    Scalar,
)
from kda_cute.problem import Call, Options, Problem
from kda_cute.specs import args_for
from tests import launch_record
from tests.launch_record import counting

F32, BF16 = torch.float32, torch.bfloat16
H200 = plans.H200
# the environment's switches are only Options' defaults: every plan here names them
OPTS = Options(alongside=True, wy="auto")
# a plan reads its kernels' manifests (threads, registers, shared memory)
needs_manifests = pytest.mark.skipif(not launch_record.CUBIN_DIR.exists(),
                                     reason="cubins not built (`make kernels`)")


def _problem(opts: Options = OPTS, **spec) -> Problem:
    return launch_record.problem_of(opts, **spec)


def _plan(opts: Options = OPTS, **spec):
    return launch_record.plan_of(opts, **spec)


def _names(pl) -> list[str]:
    return [s.name for s in pl.steps]


def _kernels(pl) -> list[str]:
    return [s.kernel.name for s in pl.launches()]


def _without_rescale(pl):
    """The plan without its rescale runs (a fast forward's K2s each have one after them)."""
    return pl.only(*(s.name for s in pl.steps if not s.name.endswith(" rescale")))


def _with(**kw) -> Options:
    return dataclasses.replace(OPTS, **kw)


# ------------------------------------------------------------------------------ plan itself
@needs_manifests
def test_plan_is_pure_and_cached(monkeypatch):
    """plan() calls no driver and asks torch.cuda nothing (every such call fails here), and
    equal arguments give the same Plan object; other arguments another."""
    p = _problem()
    others = [(p, _with(segments=3)), (p, _with(alongside=False)),
              (p, _with(precision="precise")), (_problem(T=512), OPTS),
              (_problem(seqlens=[30, 7, 45]), OPTS), (_problem(B=2, state_in="bf16"),
                                                      _with(segments=3))]

    def fail(*a, **kw):
        raise AssertionError("plan() asked torch.cuda")

    for name in ("current_device", "current_stream", "get_device_properties",
                 "get_device_capability", "is_current_stream_capturing", "device"):
        monkeypatch.setattr(torch.cuda, name, fail)
    for name in ("device", "stream", "capturing"):
        monkeypatch.setattr(launch.current, name, fail)
    plans.clear()
    with driver.substitute(object()):  # any driver call: AttributeError
        first = plans.plan(p, OPTS, H200)
        made = [plans.plan(q, o, H200) for q, o in others]
        again = plans.plan(dataclasses.replace(p), Options(alongside=True, wy="auto"), H200)
    assert again is first
    assert len({id(m) for m in made}) == len(made) and first not in made
    assert [str(m.schedule) for m in made] == ["segments 3", "serial", "serial", "alongside",
                                               "serial", "segments 3"]
    assert plans.plan(p, OPTS, dataclasses.replace(H200, sms=66)) is not first
    assert plans.plan(p) is plans.plan(p, Options())  # default options
    kda_cute.clear_caches()
    fresh = plans.plan(p, OPTS, H200)
    assert fresh is not first and fresh == first


SOURCE_TYPES = (Role, Plane, At, Scalar, CallScalar, Errors)


@needs_manifests
@pytest.mark.parametrize("name", list(launch_record.PROBLEMS))
def test_sources_cover_exactly_the_kernel_parameters(name):
    """Every Launch names a source for each of its kernel's parameter arguments (its argument
    list less the grid-only and MMA ones), in ABI order, and nothing else; each source is one
    a run can resolve."""
    spec = launch_record.PROBLEMS[name]
    call = launch_record.make_call(spec)
    opts = _spec_options(spec)
    p = checks.forward(Call(**{n: call.get(n) for n in Call._fields}), opts,
                       check_seqlens=False, cuda=False)
    pl = plans.plan(p, opts, H200)
    main = workspace.operand_offsets(p, pl.config)
    for s in pl.launches():
        # K1's side run (checkpoints) writes the side slots, after the main ones
        offsets = workspace.side_offsets(p, pl.config) if s.name == "K1 side" else main
        want = [a.name for a in args_for(s.kernel) if not a.grid_only and a.kind != "mma"]
        assert list(s.args) == want, s.name
        assert len(s.sources) == len(s.args), s.name
        for arg, src in zip(s.args, s.sources, strict=True):
            assert isinstance(src, SOURCE_TYPES), (s.name, arg, src)
            if isinstance(src, Role):
                assert src.name in Call._fields
            elif isinstance(src, Plane):
                assert offsets[src.name] == src.offset, (s.name, arg)
            elif isinstance(src, At):
                assert isinstance(src.buffer, Buffer)
            elif isinstance(src, CallScalar):
                assert src.name in ("scale", "lower_bound")
        used = {e for a in args_for(s.kernel) if a.name in s.args
                for e in a.shape + a.stride if isinstance(e, str)}
        assert {k for k, _ in s.syms} == used, s.name


def _spec_options(spec: dict) -> Options:
    """A golden spec's Options, as tests/launch_record.py makes them."""
    return checks.options(
        gate=spec.get("gate", "bounded"), qk_l2norm=spec.get("qk_l2norm", True),
        beta_sigmoid=spec.get("beta_sigmoid", True), segments=spec.get("segments"),
        config=launch_record.config_of(spec), precision=spec.get("precision", "fast"),
        alongside=spec.get("alongside", True), wy=spec.get("wy", "auto"))


@needs_manifests
def test_only_keeps_the_named_launches():
    """Plan.only: the named launches and memsets, the torch-side steps kept (a probe's K2 alone
    over its zeroed flags; K1 of a varlen batch after its offsets)."""
    pl = _plan(T=512)
    assert _names(pl.only("zero flags", "K2")) == ["zero flags", "K2"]
    var = _plan(seqlens=[30, 10])
    assert _names(var.only("K1")) == ["K1"]
    assert _names(var.only("offsets", "K1")) == ["offsets", "K1"]


@needs_manifests
def test_without_leaves_out_the_named_steps():
    """Plan.without: every step but the named ones, in order (a probe's forward without a
    step, timing only)."""
    pl = _plan(T=512)
    names = _names(pl)
    assert _names(pl.without("K2", "no such step")) == [n for n in names if n != "K2"]
    assert _names(pl.without()) == names


# -------------------------------------------------------------------------------- segments
@needs_manifests
def test_segmented_launches():
    """segments=3 on a 40-token batch of one: K1, then K2 over 3 segments from the identity (K
    rows, on the side stream) and from zero (V rows), the combine once both are done, and K2
    from the segments' starts. The first two K2 runs' outputs are not used: they run K2
    without outputs."""
    pl = _plan(_with(segments=3))
    assert str(pl.schedule) == "segments 3"
    assert _names(pl) == ["K1", "fork: identity rows beside the value rows", "K2 identity",
                          "merge: value rows", "K2 from zero", "K2 from zero rescale",
                          "join: identity rows", "combine", "K2 from starts",
                          "K2 from starts rescale"]
    assert [type(pl.steps[i]).__name__ for i in (1, 3, 6)] == ["Fork", "Merge", "Join"]
    pl = _without_rescale(pl)
    names = _kernels(pl)
    launches = pl.launches()
    grids = [s.grid for s in launches]
    assert names[0].startswith("kda_prep") and names[3] == "kda_combine_k64_r8"
    assert launches[3].kernel == combine_config(64)
    assert all(n.startswith("kda_recur") for n in names[1:3] + names[4:])
    assert [n.endswith("_noout") for n in names[1:3] + names[4:]] == [True, True, False]
    assert [s.kernel.outputs for s in launches[1:3] + launches[4:]] == [False, False, True]
    assert len(names) == 5
    assert grids[1:3] + grids[4:] == [(1, 2, 3)] * 3  # (V / 64, H, B * segments), K = V = 64
    assert grids[3] == (8, 2, 1)  # (K / rows, H, B)
    assert grids[0] == (2, 3, 1)  # K1: (H, chunks, 1), heads fastest


STATE_ARGS = ("maps", "ends", "s0f", "s0h", "starts", "final", "final_h")


@needs_manifests
@pytest.mark.parametrize("initial", ["f32", "bf16", None])
@pytest.mark.parametrize("final", ["f32", "bf16", None])
def test_segmented_combine_states(initial, final):
    """The combine reads the initial state where there is one and writes the final state, in
    its own dtype (fp32 or bf16, no copies), and its scalars say which; two sequences of three
    segments each."""
    pl = _plan(_with(segments=3), B=2, state_in=initial, state_out=final)
    comb = pl.step("combine")
    assert comb.grid == (8, 2, 2)
    # rows of maps, ends, starts: B * P; of the states: B
    syms = dict(comb.syms)
    rows = [syms[a.shape[0]] for a in args_for(comb.kernel) if a.name in STATE_ARGS]
    assert rows == [6, 6, 2, 2, 6, 2, 2]
    code = {"f32": 1, "bf16": 2, None: 0}
    assert [comb.source(n) for n in ("segments", "state_in", "state_out", "index_mode")] == [
        Scalar(3), Scalar(code[initial]), Scalar(code[final]), Scalar(0)]
    names = _names(pl)
    for arg in ("s0f", "s0h"):
        assert (comb.source(arg) == Role("initial_state")) == (initial is not None)
    for arg in ("final", "final_h"):
        assert (comb.source(arg) == Role("final_state")) == (final is not None)
    assert not any(isinstance(s, Copy) for s in pl.steps), names
    # K2's third run starts from the combine's start states
    third = pl.step("K2 from starts")
    assert third.source("s0f") == third.source("s0h") == comb.source("starts")
    assert third.source("state_in") == Scalar(1)
    assert comb.source("starts") not in (comb.source("maps"), comb.source("ends"))


# ------------------------------------------------------------------------------- precision
@needs_manifests
@pytest.mark.parametrize("precision,f16", [("fast", True), ("precise", False)])
def test_precision_picks_the_kernels(precision, f16):
    """The two ladders launch their own K1 and K2 (K = 64 here)."""
    pl = _plan(_with(precision=precision))
    assert _names(pl) == ["K1", "K2"] + (["K2 rescale"] if f16 else [])
    k1, k2 = _kernels(pl)[:2]
    assert k1.endswith("_f16") == f16 and ("_f16" in k2) == f16
    assert pl.config == select_config(64, 64, False, precision)


@needs_manifests
@pytest.mark.parametrize("K", [64, 128])
def test_fast_workspace_has_one_plane_of_kd_aw_mq(K):
    """The fast (fp16) forward's workspace holds kd, Aw and Mq once (no lo planes): smaller than
    the precise one's by exactly those planes, and its K2 reads the lo half from the same plane
    as the hi (launch.test_run: a fast-sized workspace given to a precise forward is refused)."""
    p = _problem(K=K)
    fast, precise = (ladder.config_for(p, _with(precision=m)) for m in ("fast", "precise"))
    plan_f = {n: (b, shape) for n, _, b, shape, _ in workspace.planes(p, fast)[0]}
    plan_p = {n: (b, shape) for n, _, b, shape, _ in workspace.planes(p, precise)[0]}
    for name in ("kd", "aw", "mq"):
        assert plan_f[name][1][0] == 1 and plan_p[name][1][0] == 2
        assert 2 * plan_f[name][0] == plan_p[name][0]
    assert workspace.workspace_bytes(p, fast) < workspace.workspace_bytes(p, precise)
    k2f = plans.plan(p, OPTS, H200).step("K2")
    k2p = plans.plan(p, _with(precision="precise"), H200).step("K2")
    for name in ("kd", "aw", "mq"):
        assert k2f.source(name + "l").offset == k2f.source(name + "h").offset
        assert k2p.source(name + "l").offset == k2p.source(name + "h").offset \
            + plan_p[name][0] // 2


# ------------------------------------------------------------------------------- workspace
@pytest.mark.parametrize("K", [64, 128, 256])
def test_workspace_plan_matches_views(K):
    p = Problem(1, 37, 3, K, K, 1, False)
    cfg = select_config(K, K, False)
    need = workspace.workspace_bytes(p, cfg)
    ws = torch.empty(need + 100, dtype=torch.uint8)[3:3 + need]  # a misaligned base
    views = workspace.views(ws, p, cfg)
    base = ws.data_ptr() + (-ws.data_ptr()) % 256
    planes, total = workspace.planes(p, cfg)
    assert total == need == api.workspace_bytes(p, cfg)
    assert [name for name, *_ in planes] == list(views)
    offsets = workspace.operand_offsets(p, cfg)
    for name, off, n, shape, dtype in planes:
        v = views[name]
        assert v.data_ptr() == base + off and v.data_ptr() % 256 == 0
        assert tuple(v.shape) == shape and v.dtype == dtype
        assert v.numel() * v.element_size() == n
        assert v.data_ptr() + n <= ws.data_ptr() + need
        assert offsets[name] == off  # the offsets the plan's Plane sources carry


@pytest.mark.parametrize("seqlens, chunk", [([37], 16), ([5, 0, 33, 16, 1], 16),
                                            ([1] * 40, 16), ([64, 65, 31], 32)])
def test_workspace_rows_hold_whole_chunks(seqlens, chunk):
    """K1 writes whole chunks (each sequence's last one padded): the workspace's rows must cover
    every sequence's chunks, and the token -> row map the GPU tests read K1's outputs through
    must put each sequence on fresh chunks, in order, one row per token."""
    from kda_cute.testing import token_rows

    T = sum(seqlens)
    p = Problem(1, T, 2, 64, 64, len(seqlens), True)
    nch, rows = workspace.rows(p, chunk)
    cu = torch.tensor([0, *torch.tensor(seqlens).cumsum(0).tolist()])
    r, written = token_rows(1, T, cu, chunk)
    assert rows == nch * chunk
    # K1 writes whole chunks, inside the workspace, no row twice
    assert len(written) == sum(-(-n // chunk) * chunk for n in seqlens)
    assert len(set(written.tolist())) == len(written) and int(written.max()) < rows
    assert len(r) == T and set(r.tolist()) <= set(written.tolist())
    start = 0
    for n in seqlens:
        seq = r[start:start + n]
        if n:
            assert int(seq[0]) % chunk == 0  # a sequence starts on a chunk boundary
            assert torch.equal(seq - seq[0], torch.arange(n))
        start += n


@pytest.mark.parametrize("chunk", [16, 32])
def test_chunk_slots_never_overlap(chunk):
    """workspace.chunk_slots (cu_chunks of a varlen batch, no prefix sum): random lengths, empty
    and chunk-multiple ones among them; each sequence's ceil(n / chunk) slots end at or before
    the next sequence's first, and the last ends within the B*T // chunk + N slots the
    workspace and K1's grid hold."""
    g = torch.Generator().manual_seed(chunk)
    for _ in range(50):
        n = int(torch.randint(1, 40, (1,), generator=g))
        lens = torch.randint(0, 3 * chunk, (n,), generator=g)
        lens[torch.rand(n, generator=g) < 0.3] = 0
        lens[torch.rand(n, generator=g) < 0.3] = chunk * 2
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        cc = workspace.chunk_slots(cu, chunk, torch.arange(n + 1, dtype=torch.int32))
        assert cc.dtype == torch.int32
        need = -(-lens // chunk)
        assert bool((cc[:-1] + need <= cc[1:]).all())
        assert int(cc[-1]) == int(cu[-1]) // chunk + n
        p = Problem(1, int(cu[-1]), 1, 64, 64, n, True)
        assert int(cc[-1]) <= workspace.rows(p, chunk)[0]


def test_k2_seqs_per_cta():
    """As few waves (sequences per resident K2 CTA) as one sequence per CTA, with the most
    sequences per CTA that keeps them: B32 T256 H32 K = 128 on an H200 (64 CTAs a sequence,
    264 resident) runs 8 a CTA in one wave; B8 2 a CTA; one sequence always 1."""
    f = schedule.k2_seqs_per_cta
    assert f(32, 64, 264) == 8
    assert f(8, 64, 264) == 2
    assert f(1, 128, 264) == 1
    assert f(6, 128, 264) == 3  # 768 CTAs: 3 waves either way
    assert f(32, 32, 396) == 3  # K = 64: three CTAs per SM
    for n in range(1, 80):
        k = f(n, 64, 264)
        assert 1 <= k <= min(n, 64)
        assert -(-64 * -(-n // k) // 264) * k == -(-64 * n // 264)


@needs_manifests
def test_k2_grid_takes_several_sequences_per_cta():
    # B32 T256 H32 K = 128: 8 sequences a CTA, grid z 32 / 8
    k2 = _plan(B=32, T=256, H=32, K=128).step("K2")
    assert resident(H200, resources(k2.kernel, H200.arch)) == 264
    assert k2.grid == (2, 32, 4)


# ------------------------------------------------------------------------------- alongside
@needs_manifests
def test_k2_alongside_k1_when_its_grid_takes_at_most_half_the_sms():
    # 2 K2 CTAs on an H200's 132 SMs: K2 first, alone on its SMs, waiting on K1's flags; K1
    # as its programmatic dependent, flagging each (chunk, head)
    p = _problem(T=32 * 16)
    pl = plans.plan(p, OPTS, H200)
    cfg = pl.config
    assert pl.alongside and str(pl.schedule) == "alongside"
    memset, k2, k1, rescale = pl.steps
    assert (memset.name, k2.name, k1.name, rescale.name) == ("zero flags", "K2", "K1",
                                                             "K2 rescale")
    assert isinstance(memset, Memset) and isinstance(k2, Launch) and isinstance(k1, Launch)
    nch = workspace.rows(p, cfg.chunk)[0]
    assert memset.value == 0 and memset.count == nch * p.H
    # the alongside builds of the shipped forward: K1 flags, K2 waits, in eight stages
    acfg = alongside_of(cfg)
    assert acfg.prep.alongside and acfg.recur.alongside and acfg.recur.stages == 8
    assert k2.kernel == acfg.recur and k1.kernel == acfg.prep
    assert k2.smem == H200.smem_per_block == 232448 and not k2.programmatic  # a whole SM's
    # K1 programmatic, held by its shared memory to the CTAs per SM it needs: 2 pairs on the
    # 130 SMs K2 leaves, round(12 * 2 / 130) = 0 -> at least one
    assert k1.programmatic and k1.smem == schedule.k1_alongside_smem(H200, 1) == 233472 - 1024
    assert "K1 held to 1 CTAs per SM" in pl.notes
    # both read the same flags, the ones zeroed: the workspace's flags plane
    (flags,) = [pl_ for pl_ in workspace.planes(p, cfg)[0] if pl_[0] == "flags"]
    assert k1.source("flags") == k2.source("flags") == memset.target == Plane("flags", flags[1])
    assert flags[3] == (nch * p.H,) and flags[4] == torch.int32


@needs_manifests
@pytest.mark.parametrize("why", ["many-heads", "switched-off", "segments", "short"])
def test_k1_then_k2_otherwise(why):
    # 67 K2 CTAs (K = 64: one per head) > 132 / 2; the switch; K2 over segments; a sequence
    # of fewer than 32 chunks
    H = 67 if why == "many-heads" else 2
    opts = _with(alongside=why != "switched-off", segments=3 if why == "segments" else None)
    pl = _plan(opts, H=H, T=32 * 16 - 1 if why == "short" else 32 * 16)
    cfg = pl.config
    assert not pl.alongside
    assert not any(isinstance(s, Memset) for s in pl.steps)
    k1, *rest = pl.launches()
    assert k1.name == "K1" and k1.kernel == cfg.prep and not k1.programmatic
    assert not cfg.prep.alongside
    assert k1.smem == resources(k1.kernel, H200.arch).smem
    assert rest
    for s in rest:
        # only the rescale runs are programmatic: each the dependent of the K2 right before it
        assert s.programmatic == s.name.endswith(" rescale")
        assert s.smem == resources(s.kernel, H200.arch).smem
        assert not s.kernel.name.endswith("_al") and not getattr(s.kernel, "alongside", False)
    for i, s in enumerate(rest):
        if s.programmatic:
            assert rest[i - 1].name + " rescale" == s.name


@needs_manifests
@pytest.mark.parametrize("H,T,segments,expect", [
    (2, 32 * 16, None, "alongside"), (67, 32 * 16, None, "serial"),
    (2, 32 * 16 - 1, None, "serial"), (2, 32 * 16, 3, "segments 3")],
    ids=["alongside", "many-heads", "short", "segments"])
def test_schedule_names_what_the_launch_does(H, T, segments, expect):
    opts = _with(segments=segments)
    p = _problem(opts, H=H, T=T)
    pl = plans.plan(p, opts, H200)
    cfg = pl.config
    assert str(pl.schedule) == expect
    assert pl.schedule.kind == expect.split()[0]
    assert api.schedule(p, cfg, H200, segments) == str(
        plans.plan(p, Options(config=cfg, segments=segments), H200).schedule)
    names = _kernels(pl)
    if expect == "alongside":
        acfg = alongside_of(cfg)
        assert _names(pl) == ["zero flags", "K2", "K1", "K2 rescale"]
        assert names == [acfg.recur.name, acfg.prep.name, rescale_of(cfg.recur).name]
    elif expect == "serial":
        assert _names(pl) == ["K1", "K2", "K2 rescale"]
        assert names == [cfg.prep.name, cfg.recur.name, rescale_of(cfg.recur).name]
    else:
        assert names[0] == cfg.prep.name and any(n.startswith("kda_combine") for n in names)
        assert pl.schedule.segments == 3
    text = pl.describe()
    assert api.describe(p, opts, H200) == text
    assert f"schedule: {expect}" in text.splitlines()[1]
    assert f"workspace: {pl.workspace_bytes} bytes" in text
    for i, s in enumerate(pl.steps, 1):
        if isinstance(s, Launch):
            prog = " programmatic" if s.programmatic else ""
            assert (f"{i}. {s.name}: {s.kernel.name} grid {s.grid} block {s.block[0]} "
                    f"smem {s.smem}{prog}") in text.splitlines()
        elif isinstance(s, Memset):
            assert f"{i}. {s.name}: memset {s.count} words to {s.value}" in text.splitlines()


# the shipped K1 builds' resources at K = 64, 128, 256 (make kernels' table)
K1_64, K1_128, K1_256 = (Resources(64, 77, 19840), Resources(128, 64, 26496),
                         Resources(256, 64, 52352))


@pytest.mark.parametrize("K,N,H,k2_ctas,k1,expect", [
    (64, 1, 64, 64, K1_64, 11),  # as many as fit: K1 must keep up with 64 heads
    (64, 1, 32, 32, K1_64, 4),
    (128, 1, 32, 64, K1_128, 6),
    (256, 1, 16, 64, K1_256, 2),
    (128, 2, 16, 64, K1_128, 6),  # pairs count, not heads
    (128, 1, 1, 2, K1_128, 1),  # at least one
], ids=["k64-h64", "k64-h32", "k128-h32", "k256-h16", "k128-n2", "k128-h1"])
def test_k1_alongside_ctas_the_sweeps_best(K, N, H, k2_ctas, k1, expect):
    """K1's CTAs per SM alongside K2 are the best of the H200 sweeps (docs/notes/schedules.md) where
    one was run, and the shared memory asked for holds K1 to exactly that many."""
    p = Problem(N, 1024, H, K, K, N, False)
    ctas = schedule.k1_alongside_ctas(p, k2_ctas, H200, k1)
    assert ctas == expect
    smem = max(k1.smem, schedule.k1_alongside_smem(H200, ctas))
    assert min(233472 // smem_unit(smem + 1024), resident_per_sm(H200, k1)) == ctas


@pytest.mark.parametrize("ctas", range(1, 12))
def test_k1_alongside_smem_holds_exactly(ctas):
    """The padded reservation lets exactly `ctas` K1 CTAs share an SM once each is rounded up to
    the SM's 128-byte allocation unit (an H200 sweep ran 5 and 7 CTAs per SM as 4 and 6 when the
    padding was computed to the byte: 5 x 46,694 fits 233,472, 5 x 46,720 does not)."""
    unit = smem_unit(schedule.k1_alongside_smem(H200, ctas) + 1024)
    assert unit % 128 == 0 and 233472 // unit == ctas


# ---------------------------------------------------------------------- K2's sequence order
@needs_manifests
@pytest.mark.parametrize("seqlens,H,expect", [
    ([40, 7, 90, 33, 5, 120], 128, 1),  # K2: 6 x 128 CTAs, more than one wave (528)
    ([40, 7, 90, 33, 5, 120], 2, 0),  # one wave: every CTA starts at once
    ([3] * 160, 4, 0),  # as many sequences as K2 has threads: the kernel cannot rank them
    ([3] * 159, 4, 1),
], ids=["several-waves", "one-wave", "160-seqs", "159-seqs"])
def test_k2_longest_first_for_varlen_batches_of_several_waves(seqlens, H, expect):
    pl = _plan(seqlens=seqlens, H=H)
    k2 = pl.step("K2")
    res = resources(k2.kernel, H200.arch)
    assert k2.grid == (1, H, len(seqlens))  # grid z: one sequence each
    assert (math.prod(k2.grid) > resident(H200, res)) == (H != 2)
    assert res.threads == 160
    assert k2.source("ordered") == Scalar(expect)


@needs_manifests
def test_k2_in_cu_seqlens_order_for_fixed_length_batches():
    pl = _plan(B=3, T=40, H=300, K=128)  # 1800 K2 CTAs: more than one wave
    k2 = pl.step("K2")
    assert math.prod(k2.grid) > resident(H200, resources(k2.kernel, H200.arch))
    assert k2.source("ordered") == Scalar(0)


@needs_manifests
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_k1_seq_len_is_the_fixed_length_or_zero(varlen):
    """K1 locates a fixed-length batch's chunks by arithmetic from seq_len = T; a varlen batch
    passes 0 (K1 searches cu_seqlens instead)."""
    pl = _plan(seqlens=[30, 7, 45]) if varlen else _plan(T=37)
    k1 = pl.step("K1")
    assert k1.source("seq_len") == Scalar(0 if varlen else 37)
    assert k1.source("num_seqs") == Scalar(3 if varlen else 1)
    if varlen:
        offs = pl.steps[0]
        assert isinstance(offs, Launch) and offs.name == "offsets"
        assert offs.kernel == OFFSETS and offs.grid == (1, 1, 1)
        assert k1.source("cu_chunks") == offs.source("cu_chunks")
        assert k1.source("cu_seqlens") == offs.source("cu_seqlens")


# ------------------------------------------------------------------------------------- WY
@needs_manifests
@pytest.mark.parametrize("K,H,expect_wy", [
    (128, 64, True),    # 128 K2 CTAs on 132 SMs: each alone on its SM
    (128, 96, False),   # 192: two share an SM on 60 of them
    (256, 96, True),    # K = 256's K2 holds one CTA per SM whatever the grid
    (64, 128, False)],  # no WY build at K = 64
    ids=["k128-h64", "k128-h96", "k256-h96", "k64-h128"])
def test_serial_k2_takes_the_wy_build_where_each_cta_has_its_sm(K, H, expect_wy):
    pl = _plan(_with(alongside=False), H=H, T=64, K=K)
    cfg = pl.config
    assert _names(pl) == ["K1", "K2", "K2 rescale"]
    assert _kernels(pl)[0] == cfg.prep.name
    w = wy_of(cfg.recur)
    assert _kernels(pl)[1:2] == [w.name if expect_wy else cfg.recur.name]
    assert ("K2 in its WY form" in pl.notes) == expect_wy
    if expect_wy:
        assert w in WY_RUNS and w.f16 and cfg.recur.f16
    off = _plan(_with(alongside=False, wy="off"), H=H, T=64, K=K)
    assert _kernels(off)[1:2] == [cfg.recur.name]


@needs_manifests
def test_wy_builds_and_their_checkpoints_twins_fit_one_cta_an_sm():
    """The WY K2s run only where each CTA has an SM to itself, so they may take more shared
    memory than the plain K2s (K = 128's streams more stages): each, and its checkpoints twin,
    still fits one CTA an H200 SM, and K = 128's holds at least as many stages as its plain K2."""
    for w in WY_RUNS:
        for k in (w, checkpoints_of(w)):
            res = resources(k, H200.arch)
            assert res.smem <= H200.smem_per_block and resident_per_sm(H200, res) >= 1
    plain = {r.head_dim_k: r for r in (f.recur for f in TENSOR_CORE) if r.f16}
    for w in WY_RUNS:
        assert w.stages >= plain[w.head_dim_k].stages


@needs_manifests
def test_wy_force_takes_the_wy_build_on_any_grid():
    # 192 K2 CTAs (K = 128, H = 96): two share an SM, so the plan keeps the plain K2, unless
    # wy="force" (for measuring the WY form there)
    pl = _plan(_with(alongside=False, wy="force"), H=96, T=64, K=128)
    assert _kernels(pl)[1:2] == [wy_of(pl.config.recur).name]


# ---------------------------------------------------------------------- argument validation
def _fwd_args(**kw) -> dict:
    call = launch_record.make_call({"B": 1, "T": 40, "H": 2, "K": 64})
    return {**call, "workspace": None, **kw}


@pytest.mark.parametrize("option,bad", [
    *(("segments", bad) for bad in (0, -1, 2.0, True, "2")),
    *(("precision", bad) for bad in ("FAST", "bf16", None, 1))], ids=repr)
def test_option_argument_validated(monkeypatch, option, bad):
    planned = counting(monkeypatch, plans, "plan")
    checked = counting(monkeypatch, checks, "forward")
    with pytest.raises(ValueError, match=option):
        kda_cute.fwd(**_fwd_args(), **{option: bad})
    with pytest.raises(ValueError, match=option):
        checks.options(**{option: bad})
    assert planned == [] and checked == []


def test_the_argument_tables_are_valid_otherwise(monkeypatch):
    """The call the validation tests break is a valid one: fwd checks it through to the CUDA
    requirement (a CPU run), having planned nothing."""
    planned = counting(monkeypatch, plans, "plan")
    for kw in ({}, {"segments": 2}, {"precision": "precise"}):
        with pytest.raises(ValueError, match="CUDA"):
            kda_cute.fwd(**_fwd_args(), **kw)
    assert planned == []



# --------------------------------------------------------------------------- rescale runs
@needs_manifests
@pytest.mark.parametrize("spec,expect", [
    (dict(B=2, T=64, H=64, K=128), "serial"), (dict(B=1, T=32 * 16, H=2), "alongside"),
    (dict(B=1, T=40, H=2, segments=3), "segments 3")], ids=["serial", "alongside", "segments"])
def test_fast_k2s_have_rescale_runs(spec, expect):
    """A fast forward runs each K2 of its value rows with fix_on 1, followed (after K1 where K1
    runs alongside it) by its rescale run: ladder.rescale_of's build for the head dim, the same
    arguments (the rescale words among them) but `ordered` 0, the same x and y grid and a z
    cut to about two CTAs an SM, the K2's programmatic dependent where it follows it. The
    identity run keeps fix_on 0; precise forwards run none."""
    seg = spec.pop("segments", None)
    opts = _with(segments=seg)
    pl = plans.plan(_problem(opts, **spec), opts, H200)
    assert str(pl.schedule) == expect
    names = _names(pl)
    mains = [n for n in names if n.startswith("K2") and not n.endswith(" rescale")]
    for m in mains:
        k2 = pl.step(m)
        if m == "K2 identity":
            assert k2.source("fix_on") == Scalar(0) and m + " rescale" not in names
            continue
        r = pl.step(m + " rescale")
        assert names.index(m + " rescale") == (names.index(m) + (2 if expect == "alongside"
                                                                  else 1))
        assert r.kernel == rescale_of(k2.kernel) and r.kernel.rescale and r.kernel.checkpoints
        assert not (r.kernel.wy or r.kernel.alongside) and r.kernel.f16
        assert k2.source("fix_on") == r.source("fix_on") == Scalar(1)
        assert r.source("fixes") == k2.source("fixes")
        assert r.source("ordered") == Scalar(0)
        assert all(r.source(a) == k2.source(a) for a in r.args if a not in ("ordered",))
        assert r.grid[:2] == k2.grid[:2]
        assert r.grid[2] == min(k2.grid[2], max(1, -(-2 * H200.sms // (r.grid[0] * r.grid[1]))))
        # the programmatic dependent of the K2 it redoes where it follows that K2 (the K2
        # releases it at its start; it waits for the K2 before reading); after K1 (alongside)
        # an ordinary launch
        assert r.programmatic == (expect != "alongside")
    # the words: 4 per (K2 row, head, block of 64 state rows)
    (buf,) = {pl.step(m).source("fixes").buffer for m in mains if m != "K2 identity"}
    rows = pl.problem.N * (pl.schedule.segments if expect.startswith("segments") else 1)
    assert buf.shape == (rows * pl.problem.H * pl.problem.V // 64 * 4,)
    assert dict(pl.step(mains[0]).syms)["NFX"] == buf.shape[0]
    precise = plans.plan(_problem(_with(segments=seg, precision="precise"), **spec),
                         _with(segments=seg, precision="precise"), H200)
    assert not any(n.endswith(" rescale") for n in _names(precise))
    assert all(s.source("fix_on") == Scalar(0) for s in precise.launches()
               if "fix_on" in s.args)


def test_rescale_runs_are_built_for_every_fast_head_dim():
    from kda_cute.ladder import FAST, PRECISE, RESCALE_RUNS, SIMT

    assert {r.head_dim_k for r in RESCALE_RUNS} == {64, 128, 256}
    for f in FAST:
        r = rescale_of(f.recur)
        assert r in RESCALE_RUNS and r.name.endswith("_ck_rs")
        assert rescale_of(dataclasses.replace(f.recur, wy=True)) == r
        assert rescale_of(dataclasses.replace(f.recur, outputs=False)) == r
    for f in PRECISE + SIMT:
        assert rescale_of(f.recur) is None
