"""A varlen forward's cu_seqlens checked on the device (the offsets kernel, kda_cute.specs.offsets):
the default call never syncs with the host, a bad value is never followed (the batch runs no
tokens; nothing outside the tensors is touched) and is raised naming cu_seqlens by the next call
or check_errors, and the call can be captured in a CUDA graph and replayed with new lengths."""

import pytest
import torch

import kda_cute
from kda_cute.testing import make_inputs, reference

pytestmark = pytest.mark.gpu

OUT_TOL, STATE_TOL = 3.5e-3, 2.5e-3
H, K = 4, 128


def _bits(t):
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _outputs(inp, pad=64):
    """`out` inside a NaN-poisoned buffer with guard rows either side (token rows of H * V),
    and a NaN-poisoned fp32 final state."""
    T = inp["q"].shape[1]
    buf = torch.full((T + 2 * pad, H, K), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = buf[pad:pad + T].unsqueeze(0)
    final = torch.full((inp["N"], H, K, K), float("nan"), device="cuda")
    return buf, out, final


def _fwd(inp, out, final, cu, **kw):
    kda_cute.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out,
                 inp["A_log"], inp["dt_bias"], inp["lower_bound"], inp["initial_state"], final,
                 cu, **kw)


def _check(inp, out, final, cu):
    """out and final against the float64 reference of inp with cu_seqlens = cu."""
    from kda_cute.reference import rel_err
    ref_o, ref_s = reference({**inp, "cu_seqlens": cu.to(torch.int64)})
    assert torch.isfinite(out.float()).all() and torch.isfinite(final).all()
    assert rel_err(out, ref_o) < OUT_TOL
    assert rel_err(final, ref_s) < STATE_TOL


@pytest.fixture(autouse=True)
def _clean_errors():
    """No error word left from an earlier test, none left for a later one."""
    torch.cuda.synchronize()
    try:
        kda_cute.check_errors()
    except kda_cute.DeviceValueError:
        pass
    yield
    torch.cuda.synchronize()
    try:
        kda_cute.check_errors()
    except kda_cute.DeviceValueError:
        pass


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_offsets_kernel_writes_the_checked_copy_and_slots(dtype):
    """The offsets kernel's cu_seqlens copy and chunk slots equal cu_seqlens and
    workspace.chunk_slots of it, for a batch of more entries than its threads (a loop) with
    empty sequences; the caller's cu_seqlens is not written."""
    from kda_cute import checks, plans
    from kda_cute.launch import buffers
    from kda_cute.plans.workspace import chunk_slots

    gen = torch.Generator().manual_seed(5)
    lens = torch.randint(0, 40, (700,), generator=gen)
    lens[::7] = 0
    inp = make_inputs(seqlens=lens.tolist(), H=2, K=64, seed=3)
    cu = inp["cu_seqlens"].to(dtype)
    before = cu.clone()
    out = torch.empty_like(inp["v"])
    call = kda_cute.Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out,
                         inp["A_log"], inp["dt_bias"], None, None, cu, inp["scale"],
                         inp["lower_bound"])
    opts = checks.options("bounded")
    pl = kda_cute.plan(checks.forward(call, opts), opts, plans.device_info(cu.device))
    offs = pl.step("offsets")
    kda_cute.run(pl.only("offsets"), call)
    torch.cuda.synchronize()
    s = torch.cuda.current_stream().cuda_stream
    cs = buffers.get(offs.source("cu_seqlens").buffer, cu.device, s)
    cc = buffers.get(offs.source("cu_chunks").buffer, cu.device, s)
    assert torch.equal(cs.long(), before.long())
    ramp = torch.arange(cu.numel(), dtype=torch.int32, device="cuda")
    assert torch.equal(cc, chunk_slots(before.int(), pl.config.chunk, ramp))
    assert torch.equal(cu, before)
    kda_cute.check_errors(sync=True)  # nothing reported


def test_default_varlen_call_does_not_sync(monkeypatch):
    """The default varlen forward copies nothing to the host (cu_seqlens stays on the
    device) and matches the reference."""
    inp = make_inputs(seqlens=[37, 0, 130, 16, 61], H=H, K=K, seed=7)
    _, out, final = _outputs(inp)
    cu = inp["cu_seqlens"]
    _fwd(inp, out, final, cu)  # plan and kernels loaded
    torch.cuda.synchronize()

    def no_sync(self, *a, **k):
        raise AssertionError("a tensor was copied to the host")

    for name in ("cpu", "tolist", "item"):
        monkeypatch.setattr(torch.Tensor, name, no_sync)
    out.fill_(float("nan"))
    final.fill_(float("nan"))
    _fwd(inp, out, final, cu)
    monkeypatch.undo()
    torch.cuda.synchronize()
    _check(inp, out, final, cu)


BAD = {  # five entries: four sequences of 180 tokens in all
    "decreasing": lambda T: [0, 40, 20, 150, T],
    "past-T": lambda T: [0, 40, 90, 150, T + 1],
    "negative": lambda T: [0, -16, 90, 150, T],
    "nonzero-start": lambda T: [16, 40, 90, 150, T],
    "int64-high-word": lambda T: [0, 40, 90 + (1 << 32), 150, T],
}


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
@pytest.mark.parametrize("case", list(BAD))
def test_bad_cu_seqlens_runs_nothing_and_raises(case, dtype):
    """A bad cu_seqlens value: the call writes no output row (the guard rows around `out` and
    `out` itself keep their poison), each final state is its initial state, and the next varlen
    call raises DeviceValueError naming cu_seqlens; a good call after that is correct."""
    if case == "int64-high-word" and dtype == torch.int32:
        pytest.skip("an int32 table has no high word")
    inp = make_inputs(seqlens=[40, 50, 60, 30], H=H, K=K, seed=9)
    T = inp["q"].shape[1]
    buf, out, final = _outputs(inp)
    cu = torch.tensor(BAD[case](T), dtype=dtype, device="cuda")
    poison = buf.clone()
    _fwd(inp, out, final, cu)
    torch.cuda.synchronize()
    assert torch.equal(_bits(buf), _bits(poison))
    assert torch.equal(final, inp["initial_state"])
    good = inp["cu_seqlens"].to(dtype)
    with pytest.raises(kda_cute.DeviceValueError, match="cu_seqlens"):
        _fwd(inp, out, final, good)
    _fwd(inp, out, final, good)
    torch.cuda.synchronize()
    kda_cute.check_errors()  # nothing left
    _check(inp, out, final, good)


def test_bad_cu_seqlens_raised_by_check_errors():
    """check_errors() reports a bad cu_seqlens without another call, once."""
    inp = make_inputs(seqlens=[40, 50], H=H, K=K, seed=2)
    _, out, final = _outputs(inp)
    _fwd(inp, out, final, torch.tensor([0, 60, 50], device="cuda"))
    with pytest.raises(kda_cute.DeviceValueError, match="cu_seqlens"):
        kda_cute.check_errors(sync=True)
    kda_cute.check_errors(sync=True)


def test_host_check_still_raises_at_once():
    """check_seqlens=True: the eager host check raises before anything is launched."""
    inp = make_inputs(seqlens=[40, 50], H=H, K=K, seed=2)
    _, out, final = _outputs(inp)
    with pytest.raises(ValueError, match="cu_seqlens"):
        _fwd(inp, out, final, torch.tensor([0, 60, 50], device="cuda"), check_seqlens=True)
    assert torch.isnan(out.float()).all()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_graph_replays_new_lengths(dtype):
    """The default varlen call captured once in a CUDA graph and replayed with new cu_seqlens
    values written into the captured tensor: each replay matches the reference for its
    lengths, and a bad replay is reported by check_errors."""
    lens_list = ([40, 50, 60, 30], [1, 100, 0, 79], [180, 0, 0, 0])
    inp = make_inputs(seqlens=lens_list[0], H=H, K=K, seed=4)
    buf, out, final = _outputs(inp)
    cu = inp["cu_seqlens"].to(dtype).clone()
    from kda_cute import api
    p = api.validate(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out,
                     inp["A_log"], inp["dt_bias"], inp["lower_bound"], inp["initial_state"],
                     final, cu, "bounded")
    ws = torch.empty(api.workspace_bytes(p, api.config_for(p)), dtype=torch.uint8,
                     device="cuda")

    def call():
        kda_cute.fwd(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["scale"], out,
                     inp["A_log"], inp["dt_bias"], inp["lower_bound"], inp["initial_state"],
                     final, cu, ws)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call()
    for lens in lens_list:
        new = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=dtype)
        cu.copy_(new)
        out.fill_(float("nan"))
        final.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        _check(inp, out, final, cu)
    kda_cute.check_errors(sync=True)
    cu.copy_(torch.tensor([0, 100, 90, 150, 180], dtype=dtype))
    g.replay()
    with pytest.raises(kda_cute.DeviceValueError, match="cu_seqlens"):
        kda_cute.check_errors(sync=True)


@pytest.mark.parametrize("P", [3, 8])
def test_offsets_kernel_writes_the_segments_tables(P):
    """With segments, the offsets kernel also writes each sequence's segments' cu_seqlens and
    first chunk slots, as segments.varlen_tables builds them (more entries than threads, empty
    sequences, sequences of fewer chunks than segments)."""
    from kda_cute import Options, checks, plans, segments
    from kda_cute.launch import buffers

    gen = torch.Generator().manual_seed(P)
    lens = torch.randint(0, 200, (300,), generator=gen)
    lens[::5] = 0
    inp = make_inputs(seqlens=lens.tolist(), H=2, K=128, seed=4)
    cu = inp["cu_seqlens"].to(torch.int32)
    out = torch.empty_like(inp["v"])
    call = kda_cute.Call(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], out,
                         inp["A_log"], inp["dt_bias"], None, None, cu, inp["scale"],
                         inp["lower_bound"])
    opts = Options(segments=P)
    pl = kda_cute.plan(checks.forward(call, opts), opts, plans.device_info(cu.device))
    assert str(pl.schedule) == f"segments {P}"
    # the tables are read back from the launcher's scratch cache below: start it empty so
    # that the run cannot fill it and drop them
    kda_cute.clear_caches()
    offs = pl.step("offsets")
    kda_cute.run(pl.only("offsets"), call)
    torch.cuda.synchronize()
    s = torch.cuda.current_stream().cuda_stream
    got = [buffers.get(offs.source(n).buffer, cu.device, s) for n in ("seg_cu", "seg_cc")]
    want = segments.varlen_tables(cu.tolist(), pl.config.chunk, P)
    assert [g.tolist() for g in got] == [list(w) for w in want]
    kda_cute.check_errors(sync=True)
