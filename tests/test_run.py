"""What a run hands the CUDA driver, on a CPU: kda_cute.launch with the driver faked
(tests/launch_record.py's FakeDriver, through launch.driver.substitute) and torch.cuda answering as
an H200 would.

A run packs each kernel's parameter block once per distinct set of values and reuses it (the
launch path is host time a serving loop pays on every step). These tests check that a reused
block is the block a fresh packing produces, that any change to a pointer, a stride or a scalar
produces a new one, that alongside forwards on two streams are ordered, that a bound plan
launches exactly what a run launches without checking anything again, that a repeated
`fwd` skips only the checks whose inputs cannot have changed, and that an eager serving call
like an earlier one repeats that one's launches (launch.again) only where nothing it resolved
can differ: the same metadata, addresses, device, stream and driver, no capture, no error word.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import struct
import weakref
from types import SimpleNamespace

import pytest
import torch

import kda_cute
from kda_cute import checks, errors, ladder, launch, memo, plans, serving
from kda_cute.checks import prefill as prefill_checks
from kda_cute.checks import step as step_checks
from kda_cute.launch import buffers, driver, streams
from kda_cute.plans.step import step_plan
from kda_cute.plans.steps import At, Buffer, Copy, Scalar
from kda_cute.problem import Call, Options
from kda_cute.specs import args_for
from kda_cute.specs.step import ERRORS
from tests.launch_record import (
    CUBIN_DIR,
    PROBLEMS,
    FakeDriver,
    counting,
    fake_device,
    make_call,
)

pytestmark = pytest.mark.skipif(not CUBIN_DIR.exists(), reason="cubins not built (`make kernels`)")

BF16, F32 = torch.bfloat16, torch.float32
H200 = plans.H200
CPU = torch.device("cpu")
# the environment's switches are only Options' defaults: every plan here names them
OPTS = Options(alongside=True, wy="auto")


class Driver(FakeDriver):
    """The fake driver, also noting each launch's parameter array (its address: the same
    address is the same cached block) and the events made, recorded and waited for."""

    def __init__(self):
        super().__init__()
        self.events_made = 0

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, addr, extra):  # noqa: N802
        res = super().cuLaunchKernel(f, gx, gy, gz, bx, by, bz, smem, stream, addr, extra)
        self.ops[-1]["addr"] = addr
        return res

    def cuLaunchKernelEx(self, conf, f, addr, extra):  # noqa: N802
        res = super().cuLaunchKernelEx(conf, f, addr, extra)
        self.ops[-1]["addr"] = addr
        return res

    def cuEventCreate(self, flags):  # noqa: N802
        self.events_made += 1
        return super().cuEventCreate(flags)

    def cuEventRecord(self, ev, stream):  # noqa: N802
        res = super().cuEventRecord(ev, stream)
        self.ops[-1]["event"] = ev
        return res

    def cuStreamWaitEvent(self, stream, ev, flags):  # noqa: N802
        res = super().cuStreamWaitEvent(stream, ev, flags)
        self.ops[-1]["event"] = ev
        return res


@pytest.fixture
def drv(monkeypatch):
    """A fresh fake driver and an H200 on stream 0; no cached plan, check, buffer or stream
    order before or after (the golden records start from none). The fake streams are handles
    only: selecting one for torch's ops (a bound plan's offsets and copies) does nothing, as
    it does where CUDA is absent."""
    kda_cute.clear_caches()
    d = Driver()
    # (the substitution sets the launcher's stream order and side streams aside: none inside)
    with fake_device(monkeypatch), driver.substitute(d):
        monkeypatch.setattr(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
        yield d
    kda_cute.clear_caches()


def _on_stream(monkeypatch, handle: int) -> None:
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: SimpleNamespace(cuda_stream=handle))
    monkeypatch.setattr(launch.current, "stream", lambda device: handle)


def _capturing(monkeypatch, yes: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: yes)
    monkeypatch.setattr(launch.current, "capturing", lambda: yes)


def _x(opts: Options = OPTS, **spec) -> dict:
    """A call's tensors and scalars (launch_record.make_call; B1 T40 H2 K64 fp32 states by
    default) and a workspace for its plan under `opts`."""
    spec = {"B": 1, "T": 40, "H": 2, "K": 64, **spec}
    x = make_call(spec)
    x["workspace"] = torch.empty(_plan(x, opts).workspace_bytes, dtype=torch.uint8)
    return x


def _call(x: dict) -> Call:
    return Call(**{n: x.get(n) for n in Call._fields})


def _plan(x: dict, opts: Options = OPTS):
    p = checks.forward(_call(x), opts, check_seqlens=False, cuda=False)
    return plans.plan(p, opts, H200)


def _run(x: dict, opts: Options = OPTS):
    """fwd's three steps on a CPU: checks (no CUDA requirement), plan (an H200), run."""
    pl = _plan(x, opts)
    launch.run(pl, _call(x), x["workspace"])
    return pl


def _launches(ops: list) -> list:
    return [o for o in ops if o["op"] == "launch"]


def _decoded(d: Driver, op: dict) -> list:
    """A launch's parameter blocks, each fake TMA descriptor as the arguments it was encoded
    from (the fake numbers its descriptors: a re-encoded one has another number)."""
    out = []
    for b in op["params"]:
        if len(b) == 128 and b[:8] == b"FAKETMAP":
            out.append(json.dumps(d.maps[struct.unpack_from("<Q", b, 8)[0]], sort_keys=True))
        else:
            out.append(b)
    return out


def _index(cfg, name: str) -> int:
    """The parameter index of argument `name` of kernel `cfg` (a TMA argument with a dynamic
    shape takes two: its descriptor, then its coordinates)."""
    i = 0
    for a in args_for(cfg):
        if a.grid_only:
            continue
        if a.name == name:
            return i
        i += 2 if a.kind == "tma" and any(isinstance(e, str) for e in a.shape) else 1
    raise KeyError(name)


def _param(op: dict, cfg, name: str) -> bytes:
    """The packed bytes of argument `name` in a recorded launch of kernel `cfg`."""
    return op["params"][_index(cfg, name)]


def _pointer(op: dict, cfg, name: str) -> int:
    return struct.unpack_from("<Q", _param(op, cfg, name))[0]


# ------------------------------------------------------------------------- packed blocks
def test_repeated_run_reuses_the_packed_block(drv, monkeypatch):
    x = _x()
    packed = counting(monkeypatch, driver, "pack_params")
    _run(x)
    assert len(packed) == 3  # K1, K2 and K2's rescale run
    n_maps = len(drv.maps)
    _run(x)
    assert len(packed) == 3  # nothing packed again
    k1a, k2a, ra, k1b, k2b, rb = _launches(drv.ops)
    assert [k1a["kernel"], k2a["kernel"], ra["kernel"]] == [k1b["kernel"], k2b["kernel"],
                                                            rb["kernel"]]
    assert k1a["params"] == k1b["params"] and k2a["params"] == k2b["params"]
    assert k1a["addr"] == k1b["addr"] and k2a["addr"] == k2b["addr"]  # the same cached array
    assert ra["addr"] == rb["addr"]
    assert len({k1a["addr"], k2a["addr"], ra["addr"]}) == 3
    assert len(drv.maps) == n_maps  # no descriptor encoded again


def test_cached_block_equals_a_fresh_packing(drv):
    x = _x()
    _run(x)
    cached = [_decoded(drv, o) for o in _launches(drv.ops)]
    n_maps = len(drv.maps)
    assert n_maps
    # the kernels, their packed blocks and descriptors forgotten, and the plan made again (a
    # run resolved for the old one is not reused; the launcher's buffers are kept, so every
    # address is as before): every block packed anew
    driver.clear()
    plans.clear()
    _run(x)
    fresh = [_decoded(drv, o) for o in _launches(drv.ops)[len(cached):]]
    assert len(drv.maps) == 2 * n_maps
    assert cached == fresh


CHANGES = {
    "out-pointer": lambda x: x.update(out=torch.empty_like(x["out"])),
    "state-pointer": lambda x: x.update(final_state=torch.empty_like(x["final_state"])),
    "workspace": lambda x: x.update(workspace=torch.empty_like(x["workspace"])),
    "scale": lambda x: x.update(scale=0.5),
    "lower_bound": lambda x: x.update(lower_bound=-3.0),
    "no-initial-state": lambda x: x.update(initial_state=None),
    "bf16-final-state": lambda x: x.update(final_state=x["final_state"].to(BF16)),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_any_change_repacks(drv, change):
    x = _x()
    _run(x)
    CHANGES[change](x)
    _run(x)
    launches = _launches(drv.ops)
    before, after = launches[:len(launches) // 2], launches[len(launches) // 2:]
    assert [o["kernel"] for o in before] == [o["kernel"] for o in after]
    assert any(_decoded(drv, b) != _decoded(drv, a)
               for b, a in zip(before, after, strict=True)), change


def test_token_stride_changes_the_block(drv):
    x = _x()
    pl = _run(x)
    T, H, K = 40, 2, 64
    wide = torch.randn(1, T, H * K + 64).to(BF16)[..., :H * K].view(1, T, H, K)
    x["q"] = wide
    _run(x)
    k1a, _, _, k1b, _, _ = _launches(drv.ops)
    # K1 reads q through its row stride
    assert _decoded(drv, k1a) != _decoded(drv, k1b)
    i = _index(pl.step("K1").kernel, "q")
    before, after = (json.loads(_decoded(drv, o)[i]) for o in (k1a, k1b))
    assert before["row_stride_bytes"] == [H * K * 2] and after["row_stride_bytes"] == [
        (H * K + 64) * 2]


def test_a_short_workspace_is_refused(drv):
    """A fast-sized workspace given to a precise forward is refused, naming the argument,
    before anything is launched."""
    x = _x()  # the workspace of the fast plan
    precise = Options(alongside=True, wy="auto", precision="precise")
    pl = _plan(x, precise)
    assert pl.workspace_bytes > x["workspace"].numel()
    with pytest.raises(ValueError, match="workspace"):
        launch.run(pl, _call(x), x["workspace"])
    with pytest.raises(ValueError, match="workspace"):
        launch.bind(pl, _call(x), x["workspace"])
    assert drv.ops == []
    launch.run(_plan(x), _call(x), x["workspace"])  # the fast one fits
    assert len(_launches(drv.ops)) == 3


# ----------------------------------------------------------------------------- streams
def test_alongside_forwards_on_two_streams_are_ordered_by_one_event(drv, monkeypatch):
    """Each alongside forward records one event at its end; one launched on another stream
    than the last waits for that event before it zeroes its flags (two K2 grids at once could
    leave K1 no SMs). On the same stream, no wait: the stream orders them."""
    x = _x(T=32 * 16)
    assert _plan(x).alongside
    _run(x)
    _run(x)  # same stream: no wait
    _on_stream(monkeypatch, 7)
    _run(x)
    _run(x)
    ops = [o["op"] for o in drv.ops]
    forward = ["memset_d32", "launch", "launch", "launch", "event_record"]  # + the rescale run
    assert ops == forward * 2 + ["event_wait"] + forward * 2
    assert ops.count("event_wait") == 1
    w = ops.index("event_wait")
    (event,) = {o["event"] for o in drv.ops if o["op"].startswith("event")}
    assert drv.events_made == 1
    assert drv.ops[w]["stream"] == 7  # stream 7 waits on stream 0's last forward
    assert ops[w + 1] == "memset_d32" and drv.ops[w + 1]["stream"] == 7
    assert ops[:w].count("memset_d32") == 2
    # one event, recorded after each forward's last launch, on the stream it ran on
    records = [(o["stream"], o["event"]) for o in drv.ops if o["op"] == "event_record"]
    assert records == [(0, event)] * 2 + [(7, event)] * 2


def test_no_stream_ordering_for_serial_forwards(drv, monkeypatch):
    """Serial forwards need no ordering."""
    x = _x(H=67, T=32 * 16)
    assert not _plan(x).alongside
    _run(x)
    _on_stream(monkeypatch, 7)
    _run(x)
    assert [o["op"] for o in drv.ops] == ["launch"] * 6
    assert [o["stream"] for o in drv.ops] == [0, 0, 0, 7, 7, 7]
    assert drv.events_made == 0


@pytest.mark.parametrize("entry", ["run", "bind"])
def test_forked_steps_run_on_the_side_stream(drv, monkeypatch, entry):
    """A segmented forward's identity rows run on the side stream: after an event the call's
    stream records once K1 is enqueued, and the combine waits for an event the side stream
    records after them; the value rows and their rescale run stay on the call's stream. One
    side stream a device, a pair of events a call stream (a second stream's forward waits for
    its own fork, never another stream's); the same while a capture records them."""
    x = _x(T=40)
    opts = dataclasses.replace(OPTS, segments=3)
    pl = _plan(x, opts)
    assert str(pl.schedule) == "segments 3"
    capturing = entry == "bind"
    _capturing(monkeypatch, capturing)
    for handle in (0, 7):
        _on_stream(monkeypatch, handle)
        if entry == "run":
            launch.run(pl, _call(x), x["workspace"])
        else:
            launch.bind(pl, _call(x), x["workspace"])()
    assert drv.events_made == 4
    side = {o["stream"] for o in drv.ops} - {0, 7}
    assert len(side) == 1
    (side,) = side
    for half, call in ((drv.ops[:11], 0), (drv.ops[11:], 7)):
        names = [o.get("kernel", o["op"]) for o in half]
        assert [o["op"] for o in half] == ["launch", "event_record", "event_wait", "launch",
                                           "launch", "launch", "event_record", "event_wait",
                                           "launch", "launch", "launch"]
        assert names[0].startswith("kda_prep") and names[8].startswith("kda_combine")
        assert [o["stream"] for o in half] == [call, call, side, side, call, call, side, call,
                                               call, call, call]
        fork, join = half[1]["event"], half[6]["event"]
        assert half[2]["event"] == fork and half[7]["event"] == join and fork != join
        # the identity rows (K rows from the identity) on the side stream; the value rows and
        # their rescale run (programmatic) on the call's
        assert half[3]["kernel"].endswith("_noout") and half[4]["kernel"].endswith("_noout")
        assert half[5]["programmatic"] and not half[4]["programmatic"]
    assert drv.ops[1]["event"] != drv.ops[12]["event"]  # each call stream its own events


@pytest.mark.parametrize("entry", ["run", "bind"])
def test_alongside_order_is_off_while_capturing(drv, monkeypatch, entry):
    """A captured stream cannot wait on an event recorded outside the capture: an alongside
    forward run or bound while its stream is being captured records and waits for no event
    (and a captured run's resolved steps are not kept: its buffers belong to the capture)."""
    x = _x(T=32 * 16)
    pl = _plan(x)
    assert pl.alongside
    _capturing(monkeypatch, True)
    if entry == "run":
        _run(x)
        _on_stream(monkeypatch, 7)
        _run(x)
    else:
        for handle in (0, 7):
            _on_stream(monkeypatch, handle)
            launch.bind(pl, _call(x), x["workspace"])()
    assert [o["op"] for o in drv.ops] == ["memset_d32", "launch", "launch", "launch"] * 2
    assert drv.events_made == 0
    # once the capture ends, the next alongside forward is ordered again (the first of its
    # kind since: an event recorded, nothing to wait for)
    _capturing(monkeypatch, False)
    _run(x)
    assert [o["op"] for o in drv.ops[8:]] == ["memset_d32", "launch", "launch", "launch",
                                              "event_record"]
    assert drv.events_made == 1


def test_a_new_driver_gets_its_own_kernels(monkeypatch):
    """A run's resolved steps (kernel handles, packed blocks) belong to the driver they were
    made with: after driver.substitute (or driver.clear) the same call resolves again."""
    kda_cute.clear_caches()
    with fake_device(monkeypatch):
        x, other = _x(K=128), _x(K=64)
        a, b = Driver(), Driver()
        with driver.substitute(b):
            _run(other)
        with driver.substitute(a):
            _run(x)
        with driver.substitute(b):
            _run(x)
        assert [o["kernel"] for o in _launches(b.ops[3:])] == [
            o["kernel"] for o in _launches(a.ops)]
    kda_cute.clear_caches()


# -------------------------------------------------------------------------------- bind
@pytest.mark.parametrize("schedule", ["serial", "segments", "alongside", "no-gate-params"])
def test_a_bound_call_makes_the_calls_run_made(drv, monkeypatch, schedule):
    """A bound plan launches what run launched: the same kernels, grids, parameter blocks
    (the same cached arrays), shared memory, memsets and events, in order, each time, without
    checking or planning anything again."""
    opts = Options(alongside=True, wy="auto", segments=3 if schedule == "segments" else None)
    x = _x(opts, T=32 * 16 if schedule == "alongside" else 40,
           gate_params=schedule != "no-gate-params")
    pl = _run(x, opts)
    assert str(pl.schedule) == {"segments": "segments 3"}.get(schedule, schedule.replace(
        "no-gate-params", "serial"))
    first = list(drv.ops)
    assert first
    # (as the package's names and as the prefill checks' own, which call each other)
    counts = {(mod.__name__, name): counting(monkeypatch, mod, name)
              for mod, names in ((checks, ("forward", "metadata", "options")),
                                 (prefill_checks, ("forward", "metadata", "problem", "scalars",
                                                   "addresses", "config_for", "options")))
              for name in names}
    planned = counting(monkeypatch, plans, "plan")
    bound = launch.bind(pl, _call(x), x["workspace"])
    assert drv.ops == first  # binding launches nothing
    for _ in range(2):
        bound()
    n = len(first)
    assert drv.ops[n:2 * n] == first and drv.ops[2 * n:] == first
    assert all(c == [] for c in counts.values()) and planned == []
    assert any(o["op"] == "memset_d32" for o in first) == (schedule == "alongside")
    if schedule == "segments":
        assert len(_launches(first)) == 7  # with the value runs' two rescale runs
    if schedule == "no-gate-params":
        k1 = pl.step("K1")
        assert isinstance(k1.source("A_log"), At) and isinstance(k1.source("dt_bias"), At)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_a_bound_varlen_plan_refills_the_offsets(drv, dtype):
    """A bound varlen plan launches the offsets kernel first each call: it reads the bound
    cu_seqlens (as int32 words, two an entry for int64) and writes the checked copy and the
    chunk slots that K1 and K2 read (never the caller's tensor); with check_seqlens=True the
    values are checked on the host too, and a bad one launches nothing."""
    x = _x(seqlens=[17, 23], cu32=dtype == torch.int32)
    assert x["cu_seqlens"].dtype == dtype
    pl = _plan(x)
    offs = pl.step("offsets")
    assert pl.steps[0] is offs and offs.kernel == ladder.OFFSETS
    assert offs.source("wide") == Scalar(int(dtype == torch.int64))
    assert offs.source("entries") == Scalar(3) and offs.source("tokens") == Scalar(40)
    assert offs.source("chunk_shift") == Scalar(pl.config.chunk.bit_length() - 1)
    assert dict(offs.syms)["NCW"] == (6 if dtype == torch.int64 else 3)
    k1, k2 = pl.step("K1"), pl.step("K2")
    bound = launch.bind(pl, _call(x), x["workspace"], check_seqlens=True)
    bound()
    first = list(drv.ops)
    ops = _launches(first)
    assert len(ops) == len(pl.launches())
    assert _pointer(ops[0], offs.kernel, "cu_in") == x["cu_seqlens"].data_ptr()
    cs = buffers.get(offs.source("cu_seqlens").buffer, CPU, 0)
    cc = buffers.get(offs.source("cu_chunks").buffer, CPU, 0)
    assert cs.dtype == cc.dtype == torch.int32 and cs.numel() == cc.numel() == 3
    for op, launch_ in ((ops[1], k1), (ops[-1], k2)):
        assert _pointer(op, launch_.kernel, "cu_seqlens") == cs.data_ptr()
        assert _pointer(op, launch_.kernel, "cu_chunks") == cc.data_ptr()
    assert _pointer(ops[0], offs.kernel, "cu_seqlens") == cs.data_ptr()
    assert _pointer(ops[0], offs.kernel, "cu_chunks") == cc.data_ptr()
    x["cu_seqlens"].copy_(torch.tensor([0, 3, 40]))
    bound()
    assert drv.ops[len(first):] == first  # the same pointers: refilled in place
    n = len(drv.ops)
    x["cu_seqlens"].copy_(torch.tensor([0, 30, 20]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        bound()
    assert len(drv.ops) == n  # nothing launched
    unchecked = launch.bind(pl, _call(x), x["workspace"])  # the default: the device checks
    unchecked()
    assert len(drv.ops) == n + len(first)


def _buffers_of(pl) -> set:
    """Every launcher Buffer a plan's steps read or write."""
    out = set()
    for s in pl.steps:
        if isinstance(s, Copy):
            out |= {b for b in (s.src, s.dst) if isinstance(b, Buffer)}
        elif hasattr(s, "sources"):
            out |= {src.buffer for src in s.sources if isinstance(src, At)}
    return out


def test_a_bound_plan_keeps_what_it_reads(drv):
    """The tensors a bound forward uses beyond the caller's (the segments' states and
    constants, zeros for A_log and dt_bias, the offsets) are held by the Bound, so emptying the
    launcher's caches frees none of them; dropping the Bound does."""
    opts = Options(alongside=True, wy="auto", segments=3)
    x = _x(opts, gate_params=False)
    pl = _plan(x, opts)
    bound = launch.bind(pl, _call(x), x["workspace"])
    bound()
    first = list(drv.ops)
    made = sorted(_buffers_of(pl), key=repr)
    # the states and the rescale words; zeros for v, A_log and dt_bias, the identities; K1's
    # and the segments' offsets (two tensors each)
    assert len(made) == 10
    assert sorted(b.kind for b in made) == ["eye", "scratch", "scratch", "segments", "segments",
                                            "segments", "segments", "zeros", "zeros", "zeros"]
    refs = [weakref.ref(buffers.get(b, CPU, 0)) for b in made]
    kda_cute.clear_caches()
    gc.collect()
    assert all(r() is not None for r in refs)
    # the launcher forgot them: asked again, it makes new ones
    assert all(buffers.get(b, CPU, 0) is not r() for b, r in zip(made, refs, strict=True))
    buffers.clear()
    bound()
    assert drv.ops[len(first):] == first  # the same tensors, at the same addresses
    del bound
    gc.collect()
    assert all(r() is None for r in refs)


# -------------------------------------------------------------------- fwd's repeated calls
def _fwd(x: dict) -> None:
    """kda_cute.fwd of CPU tensors: every check runs, the last (the CUDA requirement) raises."""
    with pytest.raises(ValueError, match="q: expected a CUDA tensor"):
        kda_cute.fwd(**x)


def _unchecked(**spec) -> dict:
    """_x's call, its metadata not yet checked (no check of it cached)."""
    x = _x(**spec)
    memo.clear()
    return x


def test_a_repeated_fwd_skips_the_metadata_checks(drv, monkeypatch):
    x = _unchecked()
    problem = counting(monkeypatch, prefill_checks, "problem")
    scalars = counting(monkeypatch, prefill_checks, "scalars")
    _fwd(x)
    _fwd(x)
    assert len(problem) == 1 and len(scalars) == 2


def test_a_bad_argument_after_a_repeated_call_still_raises(drv, monkeypatch):
    x = _unchecked()
    problem = counting(monkeypatch, prefill_checks, "problem")
    _fwd(x)
    _fwd(x)
    with pytest.raises((TypeError, ValueError), match="scale"):
        kda_cute.fwd(**{**x, "scale": True})
    with pytest.raises(ValueError, match="scale"):
        kda_cute.fwd(**{**x, "scale": float("nan")})
    with pytest.raises(ValueError, match="lower_bound"):
        kda_cute.fwd(**{**x, "lower_bound": -6.0})
    assert len(problem) == 1  # the scalars alone were checked again
    with pytest.raises(TypeError, match="q"):
        kda_cute.fwd(**{**x, "q": x["q"].float()})
    assert len(problem) == 2


def test_a_remembered_forward_does_not_take_false_for_null_slot_zero(drv):
    """The checks' memo keys null_slot with its type: after null_slot=0 (index 0 is padding),
    null_slot=False is checked (and refused), not taken for 0."""
    x = {**make_call(PROBLEMS["k128-varlen-pool"]), "null_slot": 0}
    memo.clear()
    _fwd(x)
    with pytest.raises(ValueError, match="null_slot"):
        kda_cute.fwd(**{**x, "null_slot": False})


# change -> whether the tensors' metadata checks run again (the scalars' always do)
CALL_CHANGES = {
    "out-pointer": (CHANGES["out-pointer"], False),
    "state-pointer": (CHANGES["state-pointer"], False),
    "workspace": (CHANGES["workspace"], False),
    "scale": (CHANGES["scale"], False),
    "lower_bound": (CHANGES["lower_bound"], False),
    "q-pointer": (lambda x: x.update(q=x["q"].clone()), False),
    "scale-type": (lambda x: x.update(scale=1), False),  # 1 == 1.0, another type
    "no-initial-state": (CHANGES["no-initial-state"], True),
    "bf16-final-state": (CHANGES["bf16-final-state"], True),
    "token-stride": (lambda x: x.update(
        q=torch.empty(1, 40, 2 * 64 + 64, dtype=BF16)[..., :128].view(1, 40, 2, 64)), True),
    "dt_bias-shape": (lambda x: x.update(dt_bias=x["dt_bias"].view(-1)), True),
    "precision": (lambda x: x.update(precision="precise"), True),
    "segments": (lambda x: x.update(segments=2), True),
    "gate": (lambda x: x.update(gate="unbounded"), True),
    "qk_l2norm": (lambda x: x.update(qk_l2norm=False), True),
}


@pytest.mark.parametrize("change", list(CALL_CHANGES))
def test_a_changed_call_is_checked_again(drv, monkeypatch, change):
    x = _unchecked()
    x["scale"] = 1.0
    problem = counting(monkeypatch, prefill_checks, "problem")
    scalars = counting(monkeypatch, prefill_checks, "scalars")
    _fwd(x)
    fn, again = CALL_CHANGES[change]
    fn(x)
    _fwd(x)
    assert len(problem) == (2 if again else 1), change
    assert len(scalars) == 2


@pytest.mark.parametrize("option", [{"wy": "off"}, {"alongside": False}],
                         ids=["wy", "alongside"])
def test_a_changed_switch_is_checked_again(drv, monkeypatch, option):
    x = _unchecked()
    problem = counting(monkeypatch, prefill_checks, "problem")
    c = _call(x)
    first = checks.forward(c, checks.options(alongside=True, wy="auto"), cuda=False)
    assert checks.forward(c, checks.options(alongside=True, wy="auto"), cuda=False) is first
    assert len(problem) == 1
    checks.forward(c, checks.options(**{"alongside": True, "wy": "auto", **option}), cuda=False)
    assert len(problem) == 2


def test_clear_caches_forgets_the_checked_metadata(drv, monkeypatch):
    x = _unchecked()
    problem = counting(monkeypatch, prefill_checks, "problem")
    _fwd(x)
    _fwd(x)
    kda_cute.clear_caches()
    _fwd(x)
    assert len(problem) == 2


def test_a_substituted_driver_leaves_no_stream_behind(monkeypatch):
    """The side stream and events a fake driver made are forgotten when its block ends, and
    those known before it are known again: a real forward after it (a GPU test in the same
    session) never launches on a fake handle, and alongside forwards stay ordered."""
    x = _x(T=40)
    opts = dataclasses.replace(OPTS, segments=3)
    streams.forget()
    before = ({0: (5, 6)}, {0: 7}, {(0, 5): (8, 9)})  # stand-ins for real handles
    for d, v in zip((streams._last, streams._side, streams._events), before, strict=True):
        d.update(v)
    try:
        with fake_device(monkeypatch), driver.substitute(Driver()):
            assert not streams._side and not streams._events and not streams._last
            monkeypatch.setattr(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
            launch.run(_plan(x, opts), _call(x), x["workspace"])
            assert streams._side and streams._events
        assert (streams._last, streams._side, streams._events) == before
    finally:
        streams.forget()
        kda_cute.clear_caches()


def test_a_capture_takes_no_cached_scratch_and_pins_its_constants(monkeypatch):
    """A captured graph keeps the addresses it was captured with while the caches may drop
    their tensors (emptied when full, or by clear): while a stream is being captured, a scratch
    is made afresh (from the capture's memory pool) even where one is cached, and a constant
    made before the capture is handed out and pinned, so emptying the caches frees it neither
    for the graph nor for later eager calls, which get it again; a constant not yet made is
    made for the capture alone."""
    buffers.clear()
    scratch = Buffer("scratch", (5,), torch.int32, ("test",))
    zeros = Buffer("zeros", (3,), torch.float32)
    eye = Buffer("eye", (2, 4, 4), torch.float32)
    cached_scratch = buffers.get(scratch, CPU, 0)
    cached_zeros = buffers.get(zeros, CPU, 0)
    monkeypatch.setattr(buffers, "capturing", lambda dev: True)
    try:
        s1, s2 = buffers.get(scratch, CPU, 0), buffers.get(scratch, CPU, 0)
        assert s1 is not cached_scratch and s2 is not cached_scratch and s1 is not s2
        assert buffers.get(zeros, CPU, 0) is cached_zeros
        made = buffers.get(eye, CPU, 0)
        assert torch.equal(made, torch.eye(4).expand(2, 4, 4))
        assert buffers.get(eye, CPU, 0) is not made  # not kept: made by the capture's kernels
        ref = weakref.ref(cached_zeros)
        del cached_zeros
        for i in range(3 * buffers._MAX):  # the constants' cache emptied several times over
            buffers.get(Buffer("zeros", (i + 10,), torch.float32), CPU, 0)
        buffers.clear()
        gc.collect()
        assert ref() is not None  # pinned
    finally:
        monkeypatch.setattr(buffers, "capturing", lambda dev: False)
    assert buffers.get(zeros, CPU, 0) is ref()  # eager calls get the pinned one back
    assert buffers.get(scratch, CPU, 0) is not cached_scratch  # cleared: made again
    assert buffers.get(eye, CPU, 0) is not made
    buffers._pinned.clear()
    buffers.clear()


# ---------------------------------------------------------------- eager serving calls repeated
@pytest.fixture
def steps(drv, monkeypatch):
    """drv, with the serving calls planned for an H200 on the CPU tensors (the device check
    skipped); no serving memo before or after."""

    def planned(c, dev):
        p, opts = c.problem, c.options
        return step_plan(p, opts)

    monkeypatch.setattr(step_checks, "on_cuda", lambda dev, what: None)
    monkeypatch.setattr(serving, "_plan", planned)
    memo.clear()
    yield drv
    memo.clear()


def _decode_x(B=3, H=2, K=64, slots=8):
    def rows():
        return torch.randn(B, 1, H, K).to(BF16)
    return dict(q=rows(), k=rows(), v=rows(), g=rows(), beta=torch.randn(B, 1, H).to(BF16),
                state=torch.randn(slots, H, K, K), state_indices=torch.arange(B, dtype=torch.int32),
                out=rows(), A_log=torch.randn(H), dt_bias=torch.randn(H, K))


def _decode(x):
    return kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"],
                           x["state_indices"], out=x["out"], A_log=x["A_log"],
                           dt_bias=x["dt_bias"], lower_bound=-5.0)


def _step_launches(d: Driver) -> list:
    return [{k: o[k] for k in ("kernel", "grid", "block", "smem", "stream", "params")}
            for o in _launches(d.ops)]


def test_a_repeated_eager_decode_launches_what_the_first_did(steps, monkeypatch):
    """An eager decode like an earlier one (the same metadata, scalars, addresses, device and
    stream) launches the steps the first resolved, without run's checks and lookups: the same
    kernel, grid and parameter bytes."""
    x = _decode_x()
    runs = counting(monkeypatch, launch, "run")
    _decode(x)
    first = _step_launches(steps)
    assert len(first) == 1 and len(runs) == 1
    for _ in range(3):
        _decode(x)
    assert len(runs) == 1
    assert _step_launches(steps) == first * 4


@pytest.mark.parametrize("change", ["q", "out", "state", "state_indices", "A_log"])
def test_a_new_address_takes_the_full_path(steps, monkeypatch, change):
    """A tensor at a new address (same metadata) misses the repeat path: run resolves the call
    again and the launch carries the new address, which then repeats in turn."""
    x = _decode_x()
    _decode(x)
    runs = counting(monkeypatch, launch, "run")
    old = x[change]
    x[change] = old.clone()
    _decode(x)
    assert len(runs) == 1
    a, b = _step_launches(steps)
    assert struct.pack("<Q", x[change].data_ptr()) in b"".join(b["params"])
    assert struct.pack("<Q", old.data_ptr()) not in b"".join(b["params"])
    assert struct.pack("<Q", old.data_ptr()) in b"".join(a["params"])
    _decode(x)
    assert len(runs) == 1 and _step_launches(steps)[2] == b


def test_new_metadata_at_the_same_address_is_planned_again(steps, monkeypatch):
    """The same addresses with other metadata (a view of the pool's first slots) are another
    memo entry: checked and planned again, not repeated."""
    x = _decode_x()
    _decode(x)
    decode_plan = counting(monkeypatch, step_checks, "decode")
    x["state"] = x["state"][:5]
    _decode(x)
    assert len(decode_plan) == 1
    a, b = _step_launches(steps)
    assert a["params"] != b["params"]  # (the pool's slot count is a parameter)


def test_another_stream_or_driver_takes_the_full_path(steps, monkeypatch):
    x = _decode_x()
    _decode(x)
    runs = counting(monkeypatch, launch, "run")
    _on_stream(monkeypatch, 7)
    _decode(x)
    assert len(runs) == 1 and _step_launches(steps)[1]["stream"] == 7
    _decode(x)
    assert len(runs) == 1
    _on_stream(monkeypatch, 0)
    _decode(x)  # stream 0's steps are still kept
    assert len(runs) == 1 and [o["stream"] for o in _step_launches(steps)] == [0, 7, 7, 0]
    with driver.substitute(Driver()) as other:  # kernels loaded again: steps resolved again
        _decode(x)
        assert len(runs) == 2 and len(_launches(other.ops)) == 1


def test_a_capture_takes_the_full_path(steps, monkeypatch):
    """While the stream captures a graph the repeat path launches nothing: run does (making
    the capture's own buffers, keeping nothing); after the capture the kept steps repeat."""
    x = _decode_x()
    _decode(x)
    runs = counting(monkeypatch, launch, "run")
    _capturing(monkeypatch, True)
    _decode(x)
    _decode(x)
    assert len(runs) == 2
    _capturing(monkeypatch, False)
    _decode(x)
    assert len(runs) == 2 and len(_step_launches(steps)) == 4


def test_a_bad_value_reported_before_a_repeated_call_still_raises(steps):
    """The repeat path reads the device's error words first, as the full path does: a word an
    earlier call's kernel set raises, naming the argument, and nothing is launched."""
    x = _decode_x()
    _decode(x)
    _decode(x)
    _, view = errors.words(0)
    view[0] = 1
    with pytest.raises(errors.DeviceValueError, match=ERRORS[0].split()[0]):
        _decode(x)
    assert len(_step_launches(steps)) == 2
    _decode(x)  # the words were cleared by the raise
    assert len(_step_launches(steps)) == 3


def _entries(entry: str):
    """A serving call of each entry on fixed tensors (B 2, T 3, H 2, K 64; pools of 9 slots)."""
    B, T, H, K = 2, 3, 2, 64
    rows = [torch.randn(B, T, H, K).to(BF16) for _ in range(4)]
    beta = torch.randn(B, T, H).to(BF16)
    pool = torch.randn(9, H, K, K)
    idx = torch.arange(B * T, dtype=torch.int32).view(B, T)
    acc = torch.tensor([1, 2], dtype=torch.int32)
    scratch = torch.randn(B, T, H, K, K)
    slots = torch.tensor([4, 7], dtype=torch.int32)
    out = torch.empty(B, T, H, K, dtype=BF16)
    gates = dict(A_log=torch.randn(H), dt_bias=torch.randn(H, K), lower_bound=-5.0)
    dense = torch.randn(B, H, K, K)
    return {
        "verify": lambda: kda_cute.verify(*rows, beta, pool, ssm_state_indices=idx,
                                          num_accepted_tokens=acc, out=out, **gates),
        "verify-scratch": lambda: kda_cute.verify(*rows, beta, pool, state_indices=slots,
                                                  intermediate_states=scratch, out=out, **gates),
        "commit": lambda: kda_cute.commit(pool, scratch, slots, acc),
        "recurrent": lambda: serving.recurrent(*rows, beta, dense, dense, out=out, **gates),
        "fla": lambda: kda_cute.fused_recurrent_kda_fwd(
            *rows, beta, initial_state=pool, state_v_first=True, ssm_state_indices=idx,
            num_accepted_tokens=acc, use_gate_in_kernel=True, out=out, **gates),
    }[entry]


@pytest.mark.parametrize("entry", ["verify", "verify-scratch", "commit", "recurrent", "fla"])
def test_every_repeated_eager_serving_call_launches_what_the_first_did(steps, monkeypatch,
                                                                       entry):
    call = _entries(entry)
    runs = counting(monkeypatch, launch, "run")
    for _ in range(3):
        call()
    first, *rest = _step_launches(steps)
    assert rest == [first, first] and len(runs) == 1


def test_a_bad_argument_after_repeated_commits_and_recurrents_still_raises(steps):
    """The memo is by metadata: a changed dtype or shape after repeated calls is checked."""
    B, H, K = 2, 2, 64
    pool, scratch = torch.randn(9, H, K, K), torch.randn(B, 3, H, K, K)
    slots, acc = torch.tensor([4, 7], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    for _ in range(2):
        kda_cute.commit(pool, scratch, slots, acc)
    with pytest.raises(TypeError, match="accepted_step"):
        kda_cute.commit(pool, scratch, slots, acc.to(torch.int16))
    rows = [torch.randn(B, 3, H, K).to(BF16) for _ in range(4)]
    beta, dense = torch.randn(B, 3, H).to(BF16), torch.randn(B, H, K, K)
    for _ in range(2):
        serving.recurrent(*rows, beta, dense, dense, gate="none")
    with pytest.raises(ValueError, match="initial_state"):
        serving.recurrent(*rows, beta, dense[:1], dense, gate="none")


def test_a_workspace_allocated_per_run_is_kept_by_its_address(drv, monkeypatch):
    """A run without a caller's workspace allocates one; its resolved steps are kept by that
    workspace's address like a caller's: the allocator handing the next run the same block
    launches the kept steps, another block resolves again (and its launches carry it)."""
    x = _x(T=200, H=4, K=128)
    pl = _plan(x)
    assert pl.workspace_bytes
    blocks = [torch.empty(pl.workspace_bytes + 4096, dtype=torch.uint8) for _ in range(2)]
    given = []

    def allocated(plan, workspace, dev):
        assert workspace is None
        return given[-1]

    monkeypatch.setattr(launch, "_workspace", allocated)
    resolved = counting(monkeypatch, launch, "_ops")
    for b in (0, 0, 1, 1, 0):
        given.append(blocks[b])
        launch.run(pl, _call(x))
    assert len(resolved) == 2
    per_run = len(_launches(drv.ops)) // 5
    for i, b in enumerate((0, 0, 1, 1, 0)):
        ptrs = []
        for op in _launches(drv.ops)[i * per_run:(i + 1) * per_run]:
            for blk in _decoded(drv, op):
                if isinstance(blk, str):
                    ptrs.append(json.loads(blk)["ptr"])
                elif len(blk) == 8:
                    ptrs.append(struct.unpack("<Q", blk)[0])
        ranges = [(t.data_ptr(), t.data_ptr() + t.numel()) for t in blocks]
        inside = [any(lo <= v < hi for v in ptrs) for lo, hi in ranges]
        assert inside == [b == 0, b == 1]


def test_a_models_layers_repeat_their_own_launches(steps, monkeypatch):
    """Forty layers' decodes (one metadata; each layer its own pool, gate weights and output)
    in turn, step after step: after the first step every call repeats its layer's launch (the
    cache holds more than a model's layers; the oldest entry goes first when it is full)."""
    layers = [_decode_x() for _ in range(40)]
    shared = layers[0]
    for x in layers[1:]:  # the tokens and slots of one step, shared by the layers
        for name in ("q", "k", "v", "g", "beta", "state_indices"):
            x[name] = shared[name]
    runs = counting(monkeypatch, launch, "run")
    for _ in range(3):
        for x in layers:
            _decode(x)
    assert len(runs) == 40
    by_layer = _step_launches(steps)
    assert by_layer[40:80] == by_layer[:40] and by_layer[80:] == by_layer[:40]
    assert len({b"".join(o["params"]) for o in by_layer[:40]}) == 40


@pytest.mark.parametrize("entry", ["decode", "bind", "fwd"])
def test_a_stream_that_is_not_one_is_named(steps, entry):
    """stream= anything but a torch.cuda.Stream (or None): a TypeError naming stream, from the
    full path, the repeat path and bind alike; nothing launched."""
    x = _decode_x()
    _decode(x)  # (the repeat path holds this call's launch)
    for odd in ("x", 7, object(), SimpleNamespace(cuda_stream="7"), torch.zeros(2)):
        with pytest.raises(TypeError, match="^stream: expected a torch.cuda.Stream"):
            if entry == "decode":
                kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"],
                                x["state_indices"], out=x["out"], A_log=x["A_log"],
                                dt_bias=x["dt_bias"], lower_bound=-5.0, stream=odd)
            elif entry == "bind":
                kda_cute.decode(x["q"], x["k"], x["v"], x["g"], x["beta"], x["state"],
                                x["state_indices"], out=x["out"], A_log=x["A_log"],
                                dt_bias=x["dt_bias"], lower_bound=-5.0, stream=odd, bind=True)
            else:
                y = _x()
                launch.run(_plan(y), _call(y), y["workspace"], stream=odd)
    assert len(_step_launches(steps)) == 1


def test_bind_check_seqlens_is_a_switch(drv):
    x = _x()
    with pytest.raises(TypeError, match="^check_seqlens: expected a bool"):
        launch.bind(_plan(x), _call(x), x["workspace"], check_seqlens=torch.zeros(2))
