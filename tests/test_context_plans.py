"""Context parallelism's two plans (kda_cute.plans.context), on the CPU: the segments schedule
split at its combine, the segments' states moved into the caller's workspace, the summary's two
combines."""

from __future__ import annotations

import pytest
import torch

from kda_cute import Options, Problem, plan
from kda_cute.plans.context import context_plans
from kda_cute.plans.steps import At, Errors, Plane, Role, Scalar
from kda_cute.specs.recur import STATE_F32, STATE_NONE

F32 = torch.float32


def _split(p, **opts):
    pl = plan(p, Options(context=True, **opts))
    return pl, *context_plans(pl)


def _launches(pl):
    return [s.name for s in pl.launches()]


@pytest.mark.parametrize("B, T, P", [(1, 4096, 4), (2, 1000, 1), (1, 64, None)])
def test_split_at_the_combine(B, T, P):
    """The summary runs everything before the combine and its two combines; the finish the
    combine and K2 from the starts: between them every launch of the forward, once."""
    full, summary, finish = _split(Problem(B, T, 2, 128, 128, B, False, state_in=F32,
                                           state_out=F32), segments=P)
    assert full.schedule.kind == "segments"
    names = _launches(full)
    at = names.index("combine")
    assert _launches(summary) == names[:at] + ["combine: bias", "combine: transition"]
    assert _launches(finish) == names[at:]
    assert "K2 identity" in names[:at] and "K2 from zero" in names[:at]
    assert names[at + 1] == "K2 from starts"


def test_varlen_one_segment_a_sequence():
    """Varlen with one segment a sequence: the sequences are the segments (K2's own offsets),
    and the finish builds them again (the offsets kernel) before its combine."""
    full, summary, finish = _split(Problem(1, 3000, 2, 128, 128, 3, True, state_in=F32,
                                           state_out=F32), segments=1)
    assert str(full.schedule) == "segments 1"
    assert _launches(finish)[:2] == ["offsets", "combine"]
    k2 = full.step("K2 from starts")
    assert k2.source("cu_seqlens") == full.step("K2 from zero").source("cu_seqlens")
    assert k2.grid[2] == 3


def test_states_live_in_the_workspace():
    """No launch of either plan reads the launcher's segment states: the ends, maps and starts
    are planes after K1's, the same addresses in both plans, and the workspace grows by them."""
    p = Problem(1, 4096, 4, 128, 128, 1, False, state_in=F32, state_out=F32)
    full, summary, finish = _split(p, segments=4)
    for pl in (summary, finish):
        for s in pl.launches():
            for x in s.sources:
                assert not (isinstance(x, At) and x.buffer.params == ("segment states",)), s.name
    N, H, K = 4, 4, 128  # four segments of one sequence
    assert summary.workspace_bytes == finish.workspace_bytes
    assert summary.workspace_bytes - full.workspace_bytes >= 3 * N * H * K * K * 4
    wrote = {summary.step("K2 from zero").source(a) for a in ("s1f", "s1h")}
    wrote |= {summary.step("K2 identity").source(a) for a in ("s1f", "s1h")}
    read = {finish.step("combine").source(a) for a in ("ends", "maps")}
    assert read == wrote and all(isinstance(x, Plane) for x in read)
    assert finish.step("K2 from starts").source("s0f") == finish.step("combine").source("starts")


def test_summary_combines():
    """B: the ends from a zero start into `bias`; A: zero ends from the identity into
    `transition`; both fp32, dense, every sequence's."""
    p = Problem(2, 2048, 2, 128, 128, 2, False, state_in=F32, state_out=F32)
    full, summary, _ = _split(p, segments=2)
    b, a = summary.step("combine: bias"), summary.step("combine: transition")
    combine = full.step("combine")
    assert b.grid == a.grid == combine.grid
    assert b.source("final") == b.source("final_h") == Role("bias")
    assert a.source("final") == a.source("final_h") == Role("transition")
    assert b.source("state_in") == Scalar(STATE_NONE) and b.source("s0f") == Errors()
    assert a.source("state_in") == Scalar(STATE_F32)
    assert a.source("s0f").buffer.kind == "eye" and a.source("ends").buffer.kind == "zeros"
    assert b.source("ends") == summary.step("K2 from zero").source("s1f")
    assert a.source("maps") == b.source("maps") == summary.step("K2 identity").source("s1f")
    for s in (a, b):
        assert s.source("state_out") == Scalar(STATE_F32)
        assert s.source("state_index") == Errors()


def test_only_segment_plans_split():
    """A plan off the segments schedule is refused, naming it; `context` plans the segments
    wherever they are possible, and not for a batch of no tokens."""
    serial = plan(Problem(1, 4096, 2, 128, 128, 1, False), Options(segments=1))
    with pytest.raises(ValueError, match="segments schedule"):
        context_plans(serial)
    assert plan(Problem(1, 0, 2, 128, 128, 1, False),
                Options(context=True)).schedule.kind != "segments"


@pytest.mark.parametrize("H, T, want", [(32, 65536, 2), (32, 524288, 2), (12, 131072, 5),
                                        (4, 65536, 8), (64, 65536, 1), (32, 256, 1)])
def test_shard_segments(H, T, want):
    """A shard's segments by the context model (segments.choose_context): 2 at 32 heads, where
    the one-GPU forward plans the plain recurrence (its summary and finish run the value rows
    twice whatever the count, so a second segment fills the SMs the identity rows leave); as
    the one-GPU segments at 12 heads; 1 for a short shard or a grid that fills the SMs."""
    p = Problem(1, T, H, 128, 128, 1, False, state_in=F32, state_out=F32)
    assert plan(p, Options(context=True)).schedule.segments == want
    if H == 32 and T >= 65536:
        assert plan(p, Options()).schedule.kind != "segments"


def _checkpointed(first: bool):
    """A fixed-length shard's forward plan with every-4096 checkpoints (`first`: from a
    boundary mid-chunk, so the side runs too), planned for context."""
    from dataclasses import replace as with_

    from kda_cute import Call, checks, plans
    from kda_cute.plans import H200
    B, T, H, K = 1, 16384, 4, 128
    x = torch.empty(B, T, H, K, dtype=torch.bfloat16)
    s = torch.empty(B, H, K, K, dtype=F32)
    kw = dict(checkpoint_state=torch.empty(8, H, K, K, dtype=torch.bfloat16),
              checkpoint_slots=torch.zeros(B, 4, dtype=torch.int32), checkpoint_every=4096)
    if first:
        kw["checkpoint_first"] = torch.full((B,), 4096 - 100, dtype=torch.int32)
    call = Call(x, x, x, x, torch.empty(B, T, H, dtype=torch.bfloat16), x, torch.empty(H),
                torch.empty(H, K), s, s, None, 0.1, -1.0, **kw)
    o = with_(checks.options(segments=4), context=True)
    return plans.plan(checks.forward(call, o, cuda=False), o, H200)


def _scratch(pl):
    return {x.buffer.params for s in pl.steps
            for x in (s.sources if hasattr(s, "sources") else (getattr(s, "target", None),))
            if isinstance(x, At) and x.buffer.kind == "scratch"}


@pytest.mark.parametrize("first", [False, True])
def test_checkpoint_tables_live_in_the_workspace(first):
    """A checkpointed shard: the preparation (the checkpoints kernel, K1's side run) in the
    summary beside K1, K2's checkpoint stores and side run in the finish; every table the
    preparation writes and the finish reads is a plane of the workspace, at the same address
    in both plans, so nothing crosses the calls in the launcher's scratch (only the rescale
    words, which each call's K2 writes before its rescale run reads them)."""
    full = _checkpointed(first)
    summary, finish = context_plans(full)
    names = [s.name for s in summary.steps]
    assert "checkpoints" in names and ("K1 side" in names) == first
    fnames = [s.name for s in finish.steps]
    assert fnames[:2] == ["combine", "K2 from starts"] and ("K2 side" in fnames) == first
    assert _scratch(summary) & _scratch(finish) == {("rescale",)}
    k2 = finish.step("K2 from starts")
    tables = {a: k2.source(a) for a in ("ck_at", "ck_to")}
    assert all(isinstance(x, Plane) for x in tables.values())
    prep = summary.step("checkpoints")
    assert {a: prep.source(a) for a in ("ck_at", "ck_to")} == tables
    if first:
        side = finish.step("K2 side")
        for a, b in (("cu_seqlens", "side_cu"), ("state_index", "side_read"),
                     ("out_index", "side_write")):
            assert side.source(a) == prep.source(b) and isinstance(side.source(a), Plane)
        zero = next(s for s in summary.steps if s.name == "zero side slots")
        assert zero.target == prep.source("side_cu")
    planes = sorted({x.offset for s in summary.launches() for x in s.sources
                     if isinstance(x, Plane) and x.name.startswith("checkpoints")})
    assert planes[0] >= full.workspace_bytes - 512 and planes[-1] < summary.workspace_bytes
    assert summary.workspace_bytes == finish.workspace_bytes


@pytest.mark.parametrize("first", [False, True])
def test_varlen_shard_checkpoints_run_in_segments(first):
    """A varlen shard with every-n checkpoints (from first boundaries, or not) plans the
    segments (its grids never shift: fixed_grid), the checkpoints kernel reading the segments'
    offsets as K2 does, the tables in the workspace; the same batch through kda_cute.fwd keeps
    its rows whole (the plain recurrence, grids shifted where first boundaries are given)."""
    from dataclasses import replace as with_

    from kda_cute import Call, checks, plans
    from kda_cute.plans import H200
    H, K, lens = 12, 128, [5000, 7000, 4384]
    T, N = sum(lens), len(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = torch.empty(1, T, H, K, dtype=torch.bfloat16)
    s = torch.empty(N, H, K, K, dtype=F32)
    kw = dict(checkpoint_state=torch.empty(16, H, K, K, dtype=torch.bfloat16),
              checkpoint_slots=torch.zeros(N, 4, dtype=torch.int32), checkpoint_every=2048)
    if first:
        kw["checkpoint_first"] = torch.full((N,), 2000, dtype=torch.int32)
    call = Call(x, x, x, x, torch.empty(1, T, H, dtype=torch.bfloat16), x, torch.empty(H),
                torch.empty(H, K), s, s, cu, 0.1, -1.0, **kw)
    o = with_(checks.options(), context=True)
    p = checks.forward(call, o, cuda=False)
    assert p.ckpt.fixed_grid and not p.ckpt.shifts
    full = plans.plan(p, o, H200)
    assert full.schedule.kind == "segments" and full.schedule.segments > 1
    seg_cu = full.step("K2 from starts").source("cu_seqlens")
    assert seg_cu.buffer.params == ("segments cu_seqlens",)
    assert full.step("checkpoints").source("cu_seqlens") == seg_cu
    assert full.step("checkpoints").source("row_segments") == Scalar(full.schedule.segments)
    summary, finish = context_plans(full)
    assert [x.name for x in finish.steps][:3] == ["offsets", "combine", "K2 from starts"]
    assert ("K2 side" in [x.name for x in finish.steps]) == first
    assert _scratch(summary) & _scratch(finish) <= {("rescale",), ("segments cu_seqlens",),
                                                    ("segments cu_chunks",), ("cu_seqlens",),
                                                    ("cu_chunks",)}
    plain = checks.options()
    q = checks.forward(call, plain, cuda=False)
    assert not q.ckpt.fixed_grid and q.ckpt.shifts == first
    assert plans.plan(q, plain, H200).schedule.kind != "segments"
