"""The segmented K2 (kda_cute.segments) on the CPU: K2's two runs over the segments emulated by the
float64 chunked twin; combined and corrected, they must give the sequential recurrence."""

from __future__ import annotations

import pytest
import torch

from kda_cute import segments
from kda_cute.chunked import chunk_intermediates, chunk_recurrence
from kda_cute.reference import preprocess

F64 = torch.float64


def _problem(B, T, H, K, V, chunk, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, gg = (torch.randn(B, T, H, K, generator=g, dtype=F64) for _ in range(3))
    v = torch.randn(B, T, H, V, generator=g, dtype=F64)
    beta = torch.randn(B, T, H, generator=g, dtype=F64)
    A_log, dt = torch.rand(H, generator=g, dtype=F64), torch.rand(H, K, generator=g, dtype=F64)
    qn, kn, a, b = preprocess(q, k, gg, beta, A_log=A_log, dt_bias=dt, lower_bound=-5.0,
                              gate="bounded", qk_l2norm=True, beta_sigmoid=True)
    inter = chunk_intermediates(qn, kn, a, b, chunk=chunk, scale=K ** -0.5)
    s0 = torch.randn(B, H, V, K, generator=g, dtype=F64)
    return inter, v, s0


@pytest.mark.parametrize("B, T, P, chunk", [(1, 200, 4, 16), (2, 131, 3, 16), (1, 64, 8, 16),
                                            (3, 77, 2, 32), (1, 15, 4, 16)])
@pytest.mark.parametrize("with_state", [True, False])
def test_segmented_equals_sequential(B, T, P, chunk, with_state):
    H, K, V = 2, 8, 12
    inter, v, s0 = _problem(B, T, H, K, V, chunk, seed=T + P)
    s0 = s0 if with_state else None
    ref_o, ref_s = chunk_recurrence(inter, v, chunk=chunk, initial_state=s0)

    cu, cc = segments.plan(B, T, chunk, P)
    assert len(cu) == len(cc) == B * P + 1 and cu[-1] == B * T
    flat = {n: x.reshape(1, B * T, H, -1) for n, x in inter.items()}
    vf = v.reshape(1, B * T, H, V)
    cu_t = torch.tensor(cu)
    # K2's three runs over all B * P segments as sequences: the value rows from zero (end
    # states), the identity rows with v = 0 (state maps), the value rows from the true starts
    _, Bs = chunk_recurrence(flat, vf, chunk=chunk, cu_seqlens=cu_t)
    eye = torch.eye(K, dtype=F64).expand(B * P, H, K, K)
    _, A = chunk_recurrence(flat, torch.zeros(1, B * T, H, K, dtype=F64), chunk=chunk,
                            cu_seqlens=cu_t, initial_state=eye)
    starts, final = segments.combine(A.view(B, P, H, K, K), Bs.view(B, P, H, V, K), s0)
    out, _ = chunk_recurrence(flat, vf, chunk=chunk, cu_seqlens=cu_t,
                              initial_state=starts.reshape(B * P, H, V, K))
    assert torch.allclose(out.view(B, T, H, V), ref_o, rtol=1e-10, atol=1e-10)
    assert torch.allclose(final, ref_s, rtol=1e-10, atol=1e-10)


def test_plan_covers_whole_chunks():
    cu, cc = segments.plan(2, 100, 16, 3)  # 7 chunks: segments of 3, 3, 1
    assert cu == [0, 48, 96, 100, 148, 196, 200]
    assert cc == [0, 3, 6, 7, 10, 13, 14]
    # more segments than chunks: the trailing segments are empty
    cu, cc = segments.plan(1, 20, 16, 4)
    assert cu == [0, 16, 20, 20, 20] and cc == [0, 1, 2, 2, 2]


@pytest.mark.parametrize("B, T, H, expected", [
    (1, 8192, 16, 4),    # 32 CTAs of 64 state rows: 4 segments keep a run at one CTA an SM
    (1, 8192, 8, 8),     # 16 CTAs: 8 fit, the combine's launches cap it at 8
    (2, 8192, 8, 4),
    (1, 4096, 12, 5),    # 24 CTAs: 5 fit in 132 SMs
    (1, 32768, 32, 1),   # 64 CTAs: half the SMs busy already, three runs lose (measured)
    (1, 8192, 32, 1),
    (1, 8192, 64, 1),    # 128 CTAs: two segments would triple the work for 2x the CTAs
    (1, 8192, 96, 1),    # 192 CTAs fill the 132 SMs already
    (1, 1024, 16, 1),    # 64 chunks: two segments at most, not worth three runs
    (1, 2048, 12, 1),    # 128 chunks: four segments' runs and combine cost the chain they save
    (1, 2048, 16, 1),
    (1, 3072, 10, 6),    # 192 chunks: six segments of 32
])
def test_choose(B, T, H, expected):
    # K2 at K = V = 128 (64-row CTAs) on 132 SMs
    assert segments.choose(B, T, H, 128, 16, 64, sms=132) == expected


def test_choose_not_below_v128():
    """K = V = 64: the plain recurrence measured faster at H16-H64 (a shorter chain per chunk)."""
    assert segments.choose(1, 8192, 16, 64, 16, 64, sms=132) == 1


@pytest.mark.parametrize("B, with_state", [(1, True), (3, True), (2, False)])
def test_combine_is_the_serial_scan(B, with_state):
    """combine against the plain loop, its start states contiguous in the launch layout, and
    the final state written into a given fp32 tensor (which may be the initial state's)."""
    P, H, K, V = 5, 2, 6, 4
    g = torch.Generator().manual_seed(B)
    A = torch.randn(B, P, H, K, K, generator=g, dtype=torch.float32)
    Bs = torch.randn(B, P, H, V, K, generator=g, dtype=torch.float32)
    s0 = torch.randn(B, H, V, K, generator=g, dtype=torch.float32) if with_state else None
    S = torch.zeros(B, H, V, K) if s0 is None else s0.clone()
    want = []
    for j in range(P):
        want.append(S)
        S = S @ A[:, j] + Bs[:, j]
    want = torch.stack(want, 1)
    buf = s0 if s0 is not None else torch.full((B, H, V, K), float("nan"))
    starts, final = segments.combine(A, Bs, s0, buf)
    assert starts.is_contiguous() and starts.shape == (B, P, H, V, K)
    assert torch.allclose(starts, want, rtol=1e-5, atol=1e-5)
    assert final is buf and torch.allclose(final, S, rtol=1e-5, atol=1e-5)
    starts2, final2 = segments.combine(A, Bs, s0 if s0 is None else want[:, 0])
    assert torch.allclose(final2, S, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B, T, chunk, P", [(1, 8192, 16, 8), (2, 100, 16, 3), (1, 20, 16, 4),
                                            (3, 77, 32, 2), (4, 0, 16, 1), (64, 33, 16, 1)])
def test_device_offsets_are_the_plan(B, T, chunk, P):
    """The launcher's offsets, built with tensor ops on the device, are segments.plan's; with
    one segment per sequence they are a fixed-length batch's own (sequence b at token b*T,
    chunk b*ceil(T/chunk))."""
    cu, cc = _device_offsets(B, T, chunk, P)
    assert (cu.tolist(), cc.tolist()) == segments.plan(B, T, chunk, P)
    if P == 1:
        b = torch.arange(B + 1)
        assert cu.tolist() == (b * T).tolist() and cc.tolist() == (b * -(-T // chunk)).tolist()


def _offsets_buffers(B, T, chunk, P):
    """The launcher's buffers of a fixed-length batch's offsets as B * P segments: token
    offsets, then chunk offsets (plans.steps.Buffer, kind "segments")."""
    from kda_cute.plans.steps import Buffer

    return tuple(Buffer("segments", (B * P + 1,), torch.int32, (B, T, chunk, P, which))
                 for which in ("cu_seqlens", "cu_chunks"))


def _device_offsets(B, T, chunk, P):
    """Those buffers' tensors as the launcher makes them (here on the CPU)."""
    from kda_cute.launch import buffers

    return tuple(buffers.get(b, torch.device("cpu"), 0) for b in _offsets_buffers(B, T, chunk, P))


@pytest.mark.parametrize("B, T, P", [(1, 8192, 8), (2, 100, 3), (4, 0, 1), (64, 33, 1)])
def test_plans_read_the_device_offsets(B, T, P):
    """A fixed-length plan's kernels read those buffers: K1 the batch's own offsets, K2's runs
    the segments' (P > 1) or the batch's (P = 1)."""
    from kda_cute import Options, Problem, plan
    from kda_cute.plans.steps import At

    pl = plan(Problem(B, T, 2, 128, 128, B, False), Options(segments=P))
    assert str(pl.schedule) == (f"segments {P}" if P > 1 else "serial")
    runs = [s for s in pl.launches() if "cu_seqlens" in s.args]
    # (each K2 of the value rows followed by its rescale run, on the same offsets)
    assert [s.name for s in runs] == (
        ["K1", "K2 identity", "K2 from zero", "K2 from zero rescale", "K2 from starts",
         "K2 from starts rescale"] if P > 1
        else ["K2", "K2 rescale"] if T == 0 else ["K1", "K2", "K2 rescale"])
    for s in runs:
        cu, cc = _offsets_buffers(B, T, pl.config.chunk, 1 if s.name == "K1" else P)
        assert (s.source("cu_seqlens"), s.source("cu_chunks")) == (At(cu), At(cc)), s.name


def test_varlen_tables():
    """A varlen batch's segments as the offsets kernel builds them: equal lengths give plan()'s
    token offsets (the chunk slots then skip one between sequences, as varlen slots do); an
    empty sequence gives empty segments; fewer chunks than segments, empty trailing ones."""
    cu, cc = segments.varlen_tables([0, 64, 128], 16, 3)
    assert cu == segments.plan(2, 64, 16, 3)[0]
    assert cc == [0, 2, 4, 5, 7, 9, 10]
    cu, cc = segments.varlen_tables([0, 100, 100, 300], 16, 3)
    assert cu == [0, 48, 96, 100, 100, 100, 100, 180, 260, 300]
    assert cc == [0, 3, 6, 7, 7, 7, 8, 13, 18, 21]
    assert segments.varlen_tables([0, 20], 16, 4) == ([0, 16, 20, 20, 20], [0, 1, 2, 2, 2])


def test_varlen_plan_reads_the_device_segments():
    """A varlen plan over segments: the offsets kernel builds the segments' tables, every K2
    run over the segments reads them (not the sequences'), unranked; pools and checkpoints
    keep the plain recurrence."""
    from kda_cute import Options, Problem, plan

    p = Problem(1, 3000, 2, 128, 128, 3, True)
    pl = plan(p, Options(segments=4))
    assert str(pl.schedule) == "segments 4"
    offs = pl.step("offsets")
    assert offs.source("segments").value == 4
    for name in ("K2 identity", "K2 from zero", "K2 from starts"):
        s = pl.step(name)
        assert s.source("cu_seqlens") == offs.source("seg_cu"), name
        assert s.source("cu_chunks") == offs.source("seg_cc"), name
        assert s.source("ordered").value == 0
    assert pl.step("K1").source("cu_seqlens") == offs.source("cu_seqlens")
    # chosen for the mean length: one sequence of 8192 tokens, 16 heads
    assert str(plan(Problem(1, 8192, 16, 128, 128, 1, True), Options()).schedule) == "segments 4"
