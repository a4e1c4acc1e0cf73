"""The launch path on a CPU: what `fwd` hands the driver, with the driver stubbed.

`fwd` packs each kernel's parameter block once per distinct call and reuses it (the launch path is
host time a serving loop pays on every step). These tests check that a reused block is the block
a fresh packing produces, that any change to a pointer, a shape, a stride or a scalar produces a
new one, and that the workspace plan the launcher addresses matches the views the tests read.
"""

from __future__ import annotations

import ctypes
import itertools
import struct

import pytest
import torch

from kda_cute import abi, api, fwd, runtime
from kda_cute.config import WY_RUNS, alongside_of, select_config, wy_of

BF16 = torch.bfloat16


class _FakeCu:
    def cuLaunchKernel(self, *a):  # noqa: N802 (the driver's name)
        return (0,)

    def CUstream(self, s):  # noqa: N802
        return s


class _Launches(list):
    """Recorded launches, and the event operations beside them."""

    def __init__(self):
        super().__init__()
        self.events = []


@pytest.fixture
def stub_driver(monkeypatch):
    """Kernels built from the manifests without a driver; launches recorded, not run (event
    operations in `.events`)."""
    launches = _Launches()
    kernels = {}

    def get_kernel(cfg, arch):
        if cfg not in kernels:
            k = object.__new__(runtime.Kernel)
            k.manifest, _ = runtime.load_manifest(cfg.name, arch)
            k.args = abi.args_for(cfg)
            k.sizes = [p[2] for p in k.manifest["params"]]
            k.block, k.smem, k._packed = tuple(k.manifest["block"]), 0, {}
            k._function = lambda device, smem=0: None
            kernels[cfg] = k
        return kernels[cfg]

    def record(self, grid, arr, stream, device, smem=0, programmatic=False):
        bufs, ptrs = arr
        blob = [ctypes.string_at(ptrs[i], len(b.raw)) for i, b in enumerate(bufs)]
        launches.append((self.manifest["name"], grid, blob, id(arr), smem, programmatic))

    monkeypatch.setattr(runtime, "get_kernel", get_kernel)
    monkeypatch.setattr(runtime, "arch_of", lambda dev: "sm_90a")
    monkeypatch.setattr(runtime, "encode_tiled", lambda dt, ptr, dims, rs, box, sw=0:
                        ptr.to_bytes(8, "little") + bytes(120))
    monkeypatch.setattr(runtime.Kernel, "_launch", record)
    monkeypatch.setattr(runtime, "memset_d32", lambda ptr, value, count, stream:
                        launches.append(("memset", ptr, value, count)))
    events = iter(range(1000, 2000))
    monkeypatch.setattr(runtime, "new_event", lambda: next(events))
    monkeypatch.setattr(runtime, "record_event", lambda ev, stream:
                        launches.events.append(("record", ev, stream)))
    monkeypatch.setattr(runtime, "wait_event", lambda stream, ev:
                        launches.events.append(("wait", stream, ev)))
    monkeypatch.setattr(api, "_alongside_last", {})
    monkeypatch.setattr(api, "_sm_budget", lambda device: (132, 233472, 232448))  # an H200's
    monkeypatch.setattr(api, "_check_device", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: type("S", (), {"cuda_stream": 0}))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(api, "_k2_resident", lambda device, k2: 264)

    class _Dev:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(torch.cuda, "device", _Dev)
    return launches


def _problem(T=40, H=2, K=64, seed=0, precision="fast"):
    g = torch.Generator().manual_seed(seed)
    q, k, gg, v = (torch.randn(1, T, H, K, generator=g).to(BF16) for _ in range(4))
    beta = torch.randn(1, T, H, generator=g).to(BF16)
    out = torch.empty_like(v)
    A_log, dt = torch.rand(H), torch.rand(H, K)
    s0 = torch.randn(1, H, K, K)
    s1 = torch.empty_like(s0)
    p = api.validate(q, k, v, gg, beta, K ** -0.5, out, A_log, dt, -5.0, s0, s1, None, "bounded")
    ws = torch.empty(api.workspace_bytes(p, api.config_for(p, precision=precision)),
                     dtype=torch.uint8)
    return dict(q=q, k=k, v=v, g=gg, beta=beta, scale=K ** -0.5, out=out, A_log=A_log,
                dt_bias=dt, lower_bound=-5.0, initial_state=s0, final_state=s1,
                cu_seqlens=None, workspace=ws)


def _run(x, **kw):
    fwd(**x, check_seqlens=False, **kw)


def test_repeated_call_reuses_the_packed_block(stub_driver):
    x = _problem()
    _run(x)
    _run(x)
    (k1a, k2a, k1b, k2b) = _kernels(stub_driver)
    assert [k1a[0], k2a[0]] == [k1b[0], k2b[0]]
    assert k1a[2] == k1b[2] and k2a[2] == k2b[2]
    assert k1a[3] == k1b[3] and k2a[3] == k2b[3]  # the same cached array


def _kernels(launches):
    """The recorded kernel launches (not the memsets)."""
    return [r for r in launches if r[0] != "memset"]


def test_cached_block_equals_a_fresh_packing(stub_driver):
    x = _problem()
    _run(x)
    cached = [r[2] for r in _kernels(stub_driver)]
    # the same call again with the cache emptied: every block is packed anew
    for k in {runtime.get_kernel(c, "sm_90a")
              for f in [select_config(64, 64, False)] for c in (f.prep, f.recur)}:
        k._packed.clear()
    api._plans.clear()  # not replayed either
    _run(x)
    fresh = [r[2] for r in _kernels(stub_driver)[2:]]
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
def test_any_change_repacks(stub_driver, change):
    x = _problem()
    _run(x)
    CHANGES[change](x)
    _run(x)
    before, after = _kernels(stub_driver)[:2], _kernels(stub_driver)[2:]
    assert any(b[2] != a[2] for b, a in zip(before, after, strict=True)), change


def test_token_stride_changes_the_block(stub_driver):
    x = _problem()
    _run(x)
    T, H, K = 40, 2, 64
    wide = torch.randn(1, T, H * K + 64).to(BF16)[..., :H * K].view(1, T, H, K)
    x["q"] = wide
    _run(x)
    assert stub_driver[0][2] != stub_driver[2][2]  # K1 reads q through its row stride


@pytest.mark.parametrize("K", [64, 128, 256])
def test_workspace_plan_matches_views(K):
    p = api.Problem(1, 37, 3, K, K, 1, False)
    cfg = select_config(K, K, False)
    need = api.workspace_bytes(p, cfg)
    ws = torch.empty(need + 100, dtype=torch.uint8)[3:3 + need]  # a misaligned base
    views = api.workspace_views(ws, p, cfg)
    base = ws.data_ptr() + (-ws.data_ptr()) % 256
    plan, total = api._workspace_plan(p, cfg)
    assert total == need
    for name, off, n, shape, dtype in plan:
        v = views[name]
        assert v.data_ptr() == base + off and v.data_ptr() % 256 == 0
        assert tuple(v.shape) == shape and v.dtype == dtype
        assert v.numel() * v.element_size() == n
        assert v.data_ptr() + n <= ws.data_ptr() + need


@pytest.mark.parametrize("seqlens, chunk", [([37], 16), ([5, 0, 33, 16, 1], 16),
                                            ([1] * 40, 16), ([64, 65, 31], 32)])
def test_workspace_rows_hold_whole_chunks(seqlens, chunk):
    """K1 writes whole chunks (each sequence's last one padded): the workspace's rows must cover
    every sequence's chunks, and the token -> row map the GPU tests read K1's outputs through
    must put each sequence on fresh chunks, in order, one row per token."""
    from kda_cute.testing import token_rows

    T = sum(seqlens)
    p = api.Problem(1, T, 2, 64, 64, len(seqlens), True)
    nch, rows = api._workspace_rows(p, chunk)
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
    """api.chunk_slots (cu_chunks of a varlen batch, no prefix sum): random lengths, empty and
    chunk-multiple ones among them; each sequence's ceil(n / chunk) slots end at or before the
    next sequence's first, and the last ends within the B*T // chunk + N slots the workspace
    and K1's grid hold."""
    g = torch.Generator().manual_seed(chunk)
    for _ in range(50):
        n = int(torch.randint(1, 40, (1,), generator=g))
        lens = torch.randint(0, 3 * chunk, (n,), generator=g)
        lens[torch.rand(n, generator=g) < 0.3] = 0
        lens[torch.rand(n, generator=g) < 0.3] = chunk * 2
        cu = torch.zeros(n + 1, dtype=torch.int32)
        cu[1:] = lens.cumsum(0)
        cc = api.chunk_slots(cu, chunk, torch.arange(n + 1, dtype=torch.int32))
        assert cc.dtype == torch.int32
        need = -(-lens // chunk)
        assert bool((cc[:-1] + need <= cc[1:]).all())
        assert int(cc[-1]) == int(cu[-1]) // chunk + n
        p = api.Problem(1, int(cu[-1]), 1, 64, 64, n, True)
        assert int(cc[-1]) <= api._workspace_rows(p, chunk)[0]


def test_segmented_launches(stub_driver):
    """segments=3 on a 40-token batch of one: K1, then K2 over 3 segments from zero (V rows),
    from the identity (K rows), the combine, and K2 from the segments' starts. The first two
    K2 runs' outputs are not used: they run K2 without outputs."""
    x = _problem()
    _run(x, segments=3)
    names = [name for name, *_ in stub_driver]
    grids = [grid for _, grid, *_ in stub_driver]
    assert names[0].startswith("kda_prep") and names[3] == "kda_combine_k64_r8"
    assert all(n.startswith("kda_recur") for n in names[1:3] + names[4:])
    assert [n.endswith("_noout") for n in names[1:3] + names[4:]] == [True, True, False]
    assert len(names) == 5
    assert grids[1:3] + grids[4:] == [(1, 2, 3)] * 3  # (V / 64, H, B * segments), K = V = 64
    assert grids[3] == (8, 2, 1)  # (K / rows, H, B)
    assert grids[0] == (2, 3, 1)  # K1: (H, chunks, 1), heads fastest


def _combine_params(blob):
    """The combine's parameters: five state tensors {pointer, NSP or NS, sS}, then segments,
    has_init, has_final."""
    ptrs = [struct.unpack_from("<Q", b)[0] for b in blob[:5]]
    rows = [struct.unpack_from("<i", b, 8)[0] for b in blob[:5]]
    flags = [struct.unpack("<i", b)[0] for b in blob[5:8]]
    return ptrs, rows, flags


@pytest.mark.parametrize("initial", ["f32", "bf16", None])
@pytest.mark.parametrize("final", ["f32", "bf16", None])
def test_segmented_combine_states(stub_driver, initial, final):
    """The combine reads the fp32 initial state where there is one (a bf16 one through an fp32
    copy), writes the fp32 final state in place (a bf16 one through an fp32 buffer), and its
    flags say which; two sequences of three segments each."""
    x = _problem()
    x2 = _problem(seed=1)
    for name in ("q", "k", "v", "g", "beta", "out"):
        x[name] = torch.cat([x[name], x2[name]])
    for name in ("initial_state", "final_state"):
        x[name] = torch.cat([x[name], x2[name]])
        kind = initial if name == "initial_state" else final
        x[name] = None if kind is None else x[name].to(BF16 if kind == "bf16" else torch.float32)
    p = api.validate(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"],
                     x["A_log"], x["dt_bias"], -5.0, None, None, None, "bounded")
    x["workspace"] = torch.empty(api.workspace_bytes(p, api.config_for(p)), dtype=torch.uint8)
    _run(x, segments=3)
    (name, grid, blob, *_), = [r for r in stub_driver if r[0].startswith("kda_combine")]
    assert grid == (8, 2, 2)
    ptrs, rows, flags = _combine_params(blob)
    assert rows == [6, 6, 2, 6, 2]  # maps, ends, s0, starts (B * P); final (B)
    assert flags == [3, int(initial is not None), int(final is not None)]
    if initial == "f32":
        assert ptrs[2] == x["initial_state"].data_ptr()
    elif initial == "bf16":
        assert ptrs[2] != x["initial_state"].data_ptr()
    if final == "f32":
        assert ptrs[4] == x["final_state"].data_ptr()
    elif final == "bf16":
        assert ptrs[4] != x["final_state"].data_ptr()
    # K2's third run starts from the combine's start states
    third = [r for r in stub_driver if r[0].startswith("kda_recur")][-1]
    assert ptrs[3].to_bytes(8, "little") in b"".join(third[2])


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "2"])
def test_segments_argument_validated(stub_driver, bad):
    x = _problem()
    with pytest.raises(ValueError, match="segments"):
        fwd(**x, segments=bad)


@pytest.mark.parametrize("bad", ["FAST", "bf16", None, 1])
def test_precision_argument_validated(stub_driver, bad):
    x = _problem()
    with pytest.raises(ValueError, match="precision"):
        fwd(**x, precision=bad)
    assert stub_driver == []


@pytest.mark.parametrize("precision,f16", [("fast", True), ("precise", False)])
def test_precision_picks_the_kernels(stub_driver, precision, f16):
    """The two ladders launch their own K1 and K2 (K = 64 here), each in its own workspace."""
    x = _problem(precision=precision)
    _run(x, precision=precision)
    k1, k2 = _kernels(stub_driver)
    assert k1[0].endswith("_f16") == f16 and ("_f16" in k2[0]) == f16


@pytest.mark.parametrize("K", [64, 128])
def test_fast_workspace_has_one_plane_of_kd_aw_mq(stub_driver, K):
    """The fast (fp16) forward's workspace holds kd, Aw and Mq once (no lo planes): smaller than
    the precise one's by exactly those planes; a fast-sized workspace given to a precise forward
    is refused, naming the argument."""
    x = _problem(K=K)
    p = api.validate(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"], x["A_log"],
                     x["dt_bias"], -5.0, x["initial_state"], x["final_state"], None, "bounded")
    fast, precise = (api.config_for(p, precision=m) for m in ("fast", "precise"))
    plan_f = {n: (b, shape) for n, _, b, shape, _ in api._workspace_plan(p, fast)[0]}
    plan_p = {n: (b, shape) for n, _, b, shape, _ in api._workspace_plan(p, precise)[0]}
    for name in ("kd", "aw", "mq"):
        assert plan_f[name][1][0] == 1 and plan_p[name][1][0] == 2
        assert 2 * plan_f[name][0] == plan_p[name][0]
    assert api.workspace_bytes(p, fast) < api.workspace_bytes(p, precise)
    with pytest.raises(ValueError, match="workspace"):
        _run(x, precision="precise")


def test_k2_seqs_per_cta():
    """As few waves (sequences per resident K2 CTA) as one sequence per CTA, with the most
    sequences per CTA that keeps them: B32 T256 H32 K = 128 on an H200 (64 CTAs a sequence,
    264 resident) runs 8 a CTA in one wave; B8 2 a CTA; one sequence always 1."""
    assert api.k2_seqs_per_cta(32, 64, 264) == 8
    assert api.k2_seqs_per_cta(8, 64, 264) == 2
    assert api.k2_seqs_per_cta(1, 128, 264) == 1
    assert api.k2_seqs_per_cta(6, 128, 264) == 3  # 768 CTAs: 3 waves either way
    assert api.k2_seqs_per_cta(32, 32, 396) == 3  # K = 64: three CTAs per SM
    for n in range(1, 80):
        k = api.k2_seqs_per_cta(n, 64, 264)
        assert 1 <= k <= min(n, 64)
        assert -(-64 * -(-n // k) // 264) * k == -(-64 * n // 264)


def _param(launch, cfg_of, name):
    """The packed bytes of argument `name` in a recorded launch (`cfg_of`: its config)."""
    i = 0
    for a in abi.args_for(cfg_of):
        if a.grid_only:
            continue
        if a.name == name:
            return launch[2][i]
        i += 2 if a.kind == "tma" and any(isinstance(e, str) for e in a.shape) else 1
    raise KeyError(name)


def _with_heads(H, T=40, K=64):
    """A problem with H heads (K2's grid: V / block_v x H CTAs for one sequence)."""
    x = _problem(T=T, H=H, K=K)
    return x, api.validate(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"],
                           x["A_log"], x["dt_bias"], -5.0, None, None, None, "bounded")


def test_k2_alongside_k1_when_its_grid_takes_at_most_half_the_sms(stub_driver):
    # 2 K2 CTAs on an H200's 132 SMs: K2 first, alone on its SMs, waiting on K1's flags; K1
    # as its programmatic dependent, flagging each (chunk, head)
    x, p = _with_heads(2, T=32 * 16)
    cfg = api.config_for(p)
    _run(x)
    memset, k2, k1 = stub_driver
    nch = api._workspace_rows(p, cfg.chunk)[0]
    flags = api.workspace_views(x["workspace"], p, cfg)["flags"]
    assert memset[0] == "memset" and memset[2:] == (0, nch * p.H)
    # the alongside builds of the shipped forward: K1 flags, K2 waits, in eight stages
    acfg = alongside_of(cfg)
    assert acfg.prep.alongside and acfg.recur.alongside and acfg.recur.stages == 8
    assert k2[0] == acfg.recur.name and k1[0] == acfg.prep.name
    assert k2[4] == 232448 and not k2[5]  # a whole SM's shared memory: no K1 CTA beside it
    # K1 programmatic, held by its shared memory to the CTAs per SM it needs: 2 pairs on the
    # 130 SMs K2 leaves, round(12 * 2 / 130) = 0 -> at least one
    assert k1[5] and k1[4] == api._k1_alongside_smem(0, 1) == 233472 - 1024
    # both read the same flags, the ones zeroed
    f1 = struct.unpack_from("<Q", _param(k1, acfg.prep, "flags"))[0]
    f2 = struct.unpack_from("<Q", _param(k2, acfg.recur, "flags"))[0]
    assert f1 == f2 == memset[1] == flags.data_ptr() and flags.numel() == nch * p.H


@pytest.mark.parametrize("why", ["many-heads", "switched-off", "segments", "short"])
def test_k1_then_k2_otherwise(stub_driver, monkeypatch, why):
    # 67 K2 CTAs (K = 64: one per head) > 132 / 2; the switch; K2 over segments; a sequence
    # of fewer than 32 chunks
    H = 67 if why == "many-heads" else 2
    if why == "switched-off":
        monkeypatch.setenv("KDA_CUTE_ALONGSIDE", "0")
    x, p = _with_heads(H, T=32 * 16 - 1 if why == "short" else 32 * 16)
    cfg = api.config_for(p)
    _run(x, segments=3 if why == "segments" else None)
    assert not any(r[0] == "memset" for r in stub_driver)
    k1 = stub_driver[0]
    assert k1[0] == cfg.prep.name and not k1[5] and not cfg.prep.alongside
    for r in stub_driver[1:]:
        assert not r[5] and r[4] == 0
        assert not r[0].endswith("_al")  # the builds without flags


@pytest.mark.parametrize("H,T,segments,expect", [
    (2, 32 * 16, None, "alongside"), (67, 32 * 16, None, "serial"),
    (2, 32 * 16 - 1, None, "serial"), (2, 32 * 16, 3, "segments 3")])
def test_schedule_names_what_the_launch_does(stub_driver, H, T, segments, expect):
    x, p = _with_heads(H, T=T)
    cfg = api.config_for(p)
    assert api.schedule(p, cfg, 0, segments) == expect
    _run(x, segments=segments)
    names = [r[0] for r in stub_driver]
    if expect == "alongside":
        acfg = alongside_of(cfg)
        assert names == ["memset", acfg.recur.name, acfg.prep.name]
    elif expect == "serial":
        assert names == [cfg.prep.name, cfg.recur.name]
    else:
        assert names[0] == cfg.prep.name and any(n.startswith("kda_combine") for n in names)


@pytest.mark.parametrize("mode,expect", [
    ("serial", ["prep", "recur"]), ("alongside", [0, "recur", "prep"]),
    ("preset", [1, "recur", "prep"]), ("k2-only", [1, "recur"])])
def test_alongside_probe_schedules(stub_driver, monkeypatch, mode, expect):
    """bench/alongside_probe.py's four schedules launch what its docstring says, and leave the
    launcher as they found it."""
    import sys
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    monkeypatch.delenv("KDA_CUTE_ALONGSIDE", raising=False)
    probe = __import__("alongside_probe")
    x, p = _with_heads(2, T=32 * 16)
    cfg = api.config_for(p)
    before = (runtime.memset_d32, runtime.Kernel.launch_with)
    with probe._Schedule(mode):
        _run(x)
    assert (runtime.memset_d32, runtime.Kernel.launch_with) == before
    assert "KDA_CUTE_ALONGSIDE" not in __import__("os").environ
    names = ({"prep": cfg.prep.name, "recur": cfg.recur.name} if mode == "serial" else
             {"prep": alongside_of(cfg).prep.name, "recur": alongside_of(cfg).recur.name})
    got = [r[2] if r[0] == "memset" else r[0] for r in stub_driver]
    assert got == [names.get(e, e) for e in expect]
    del sys.modules["alongside_probe"]


class _K1Resources:
    """A K1 kernel's resources as the launcher reads them (block, registers, shared memory)."""

    def __init__(self, threads: int, registers: int, smem: int):
        self.block, self.manifest, self.smem = (threads, 1, 1), {"registers": registers}, smem


# the shipped K1 builds' resources at K = 64, 128, 256 (make kernels' table)
_K1_64, _K1_128, _K1_256 = (_K1Resources(64, 77, 19840), _K1Resources(128, 64, 26496),
                            _K1Resources(256, 64, 52352))


@pytest.mark.parametrize("K,N,H,k2_ctas,k1,expect", [
    (64, 1, 64, 64, _K1_64, 11),  # as many as fit: K1 must keep up with 64 heads
    (64, 1, 32, 32, _K1_64, 4),
    (128, 1, 32, 64, _K1_128, 6),
    (256, 1, 16, 64, _K1_256, 2),
    (128, 2, 16, 64, _K1_128, 6),  # pairs count, not heads
    (128, 1, 1, 2, _K1_128, 1),  # at least one
])
def test_k1_alongside_ctas_the_sweeps_best(monkeypatch, K, N, H, k2_ctas, k1, expect):
    """K1's CTAs per SM alongside K2 are the best of the H200 sweeps (bench/NOTES.md) where
    one was run, and the shared memory asked for holds K1 to exactly that many."""
    import types
    monkeypatch.setattr(api, "_sm_budget", lambda device: (132, 233472, 232448))
    p = types.SimpleNamespace(K=K, N=N, H=H)
    ctas = api._k1_alongside_ctas(p, k2_ctas, 0, k1)
    assert ctas == expect
    smem = max(k1.smem, api._k1_alongside_smem(0, ctas))
    assert min(233472 // api._smem_unit(smem + 1024), api._resident_per_sm(0, k1)) == ctas


def _varlen(seqlens, H, K=64, seed=1):
    """A varlen problem (B = 1, cu_seqlens int32) as fwd's keyword arguments."""
    x = _problem(T=sum(seqlens), H=H, K=K, seed=seed)
    N = len(seqlens)
    cu = torch.tensor([0] + list(itertools.accumulate(seqlens)), dtype=torch.int32)
    s0 = torch.randn(N, H, K, K)
    x.update(cu_seqlens=cu, initial_state=s0, final_state=torch.empty_like(s0))
    p = api.validate(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"],
                     x["A_log"], x["dt_bias"], -5.0, s0, x["final_state"], cu, "bounded")
    x["workspace"] = torch.empty(api.workspace_bytes(p, api.config_for(p)), dtype=torch.uint8)
    return x, p


@pytest.mark.parametrize("seqlens,H,expect", [
    ([40, 7, 90, 33, 5, 120], 64, 1),  # K2: 6 x 64 CTAs, more than one wave (264)
    ([40, 7, 90, 33, 5, 120], 2, 0),  # one wave: every CTA starts at once
    ([3] * 160, 2, 0),  # as many sequences as K2 has threads: the kernel cannot rank them
    ([3] * 159, 2, 1),
])
def test_k2_longest_first_for_varlen_batches_of_several_waves(stub_driver, seqlens, H, expect):
    x, p = _varlen(seqlens, H)
    cfg = api.config_for(p)
    _run(x)
    (k2,) = [r for r in stub_driver if r[0] == cfg.recur.name]
    assert k2[1] == (1, H, len(seqlens))  # grid z: one sequence each
    assert struct.unpack("<i", _param(k2, cfg.recur, "ordered"))[0] == expect


def test_k2_in_cu_seqlens_order_for_fixed_length_batches(stub_driver):
    x = _problem(T=40, H=300)  # 300 K2 CTAs: more than one wave
    p = api.validate(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"],
                     x["A_log"], x["dt_bias"], -5.0, None, None, None, "bounded")
    cfg = api.config_for(p)
    _run(x)
    (k2,) = [r for r in stub_driver if r[0] == cfg.recur.name]
    assert struct.unpack("<i", _param(k2, cfg.recur, "ordered"))[0] == 0


def _on_stream(monkeypatch, handle):
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: type("S", (), {"cuda_stream": handle}))


def test_alongside_forwards_on_two_streams_do_not_overlap(stub_driver, monkeypatch):
    """Each alongside forward records one event after its K1; one launched on another stream
    than the last waits for that event before it zeroes its flags (two K2 grids at once could
    leave K1 no SMs). On the same stream, no wait: the stream orders them."""
    x, _ = _with_heads(2, T=32 * 16)
    monkeypatch.setattr(runtime, "wait_event", lambda stream, ev:
                        stub_driver.append(("wait", stream, ev)))
    _run(x)
    _run(x)  # same stream: no wait
    _on_stream(monkeypatch, 7)
    _run(x)
    _run(x)
    names = [r[0] for r in stub_driver]
    assert names.count("wait") == 1
    w = names.index("wait")
    assert stub_driver[w] == ("wait", 7, 1000)  # stream 7 waits on stream 0's last forward
    assert names[w + 1] == "memset" and names[:w].count("memset") == 2
    # one event, recorded after each forward's K1, on the stream it ran on
    assert stub_driver.events == [("record", 1000, 0)] * 2 + [("record", 1000, 7)] * 2


@pytest.mark.parametrize("why", ["serial", "capturing"])
def test_no_stream_ordering_otherwise(stub_driver, monkeypatch, why):
    """Serial forwards need no ordering; a captured stream cannot wait on an event recorded
    outside the capture, so capture skips it."""
    x, _ = _with_heads(2 if why == "capturing" else 67, T=32 * 16)
    if why == "capturing":
        monkeypatch.setattr(api, "_capturing", lambda dev: True)
    _run(x)
    _on_stream(monkeypatch, 7)
    _run(x)
    assert stub_driver.events == []
    assert any(r[0] == "memset" for r in stub_driver) == (why == "capturing")


@pytest.mark.parametrize("ctas", range(1, 12))
def test_k1_alongside_smem_holds_exactly(monkeypatch, ctas):
    """The padded reservation lets exactly `ctas` K1 CTAs share an SM once each is rounded up to
    the SM's 128-byte allocation unit (an H200 sweep ran 5 and 7 CTAs per SM as 4 and 6 when the
    padding was computed to the byte: 5 x 46,694 fits 233,472, 5 x 46,720 does not)."""
    monkeypatch.setattr(api, "_sm_budget", lambda device: (132, 233472, 232448))
    unit = api._smem_unit(api._k1_alongside_smem(0, ctas) + 1024)
    assert unit % 128 == 0 and 233472 // unit == ctas


@pytest.mark.parametrize("varlen", [False, True])
def test_k1_seq_len_is_the_fixed_length_or_zero(stub_driver, varlen):
    """K1 locates a fixed-length batch's chunks by arithmetic from seq_len = T; a varlen batch
    passes 0 (K1 searches cu_seqlens instead)."""
    if varlen:
        x, p = _varlen([30, 7, 45], H=2)
    else:
        x = _problem(T=37)
        p = api.validate(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], x["out"],
                         x["A_log"], x["dt_bias"], -5.0, None, None, None, "bounded")
    cfg = api.config_for(p)
    _run(x)
    (k1,) = [r for r in stub_driver if r[0] == cfg.prep.name]
    assert struct.unpack("<i", _param(k1, cfg.prep, "seq_len"))[0] == (0 if varlen else 37)


@pytest.mark.parametrize("K,H,expect_wy", [
    (128, 64, True),    # 128 K2 CTAs on 132 SMs: each alone on its SM
    (128, 96, False),   # 192: two share an SM on 60 of them
    (256, 96, True),    # K = 256's K2 holds one CTA per SM whatever the grid
    (64, 128, False)])  # no WY build at K = 64
def test_serial_k2_takes_the_wy_build_where_each_cta_has_its_sm(stub_driver, monkeypatch, K,
                                                                 H, expect_wy):
    monkeypatch.setenv("KDA_CUTE_ALONGSIDE", "0")
    x, p = _with_heads(H, T=64, K=K)
    cfg = api.config_for(p)
    _run(x)
    names = [r[0] for r in stub_driver]
    assert names[0] == cfg.prep.name
    w = wy_of(cfg.recur)
    assert names[1:] == [w.name if expect_wy else cfg.recur.name]
    if expect_wy:
        assert w in WY_RUNS and w.f16 and cfg.recur.f16
    monkeypatch.setenv("KDA_CUTE_WY", "0")
    stub_driver.clear()
    _run(x)
    assert [r[0] for r in stub_driver][1:] == [cfg.recur.name]


def test_wy_force_takes_the_wy_build_on_any_grid(stub_driver, monkeypatch):
    # 192 K2 CTAs (K = 128, H = 96): two share an SM, so the launcher keeps the plain K2, unless
    # KDA_CUTE_WY=force (for measuring the WY form there)
    monkeypatch.setenv("KDA_CUTE_ALONGSIDE", "0")
    monkeypatch.setenv("KDA_CUTE_WY", "force")
    x, p = _with_heads(96, T=64, K=128)
    cfg = api.config_for(p)
    _run(x)
    assert [r[0] for r in stub_driver][1:] == [wy_of(cfg.recur).name]


def _count_validations(monkeypatch) -> list:
    """api.validate wrapped to count its calls (the full path validates; a replay does not)."""
    calls = []
    real = api.validate

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(api, "validate", counted)
    return calls


@pytest.mark.parametrize("schedule", ["serial", "segments", "alongside", "no-gate-params"])
def test_repeated_call_replays_the_recorded_launches(stub_driver, monkeypatch, schedule):
    """A second call with the same tensors and options replays the first call's launches:
    the same kernels, grids, parameter blocks, shared memory and memsets, in order, without
    validating or choosing again."""
    x, _ = _with_heads(2, T=32 * 16 if schedule == "alongside" else 40)
    if schedule == "no-gate-params":
        x.update(A_log=None, dt_bias=None)  # zeros the launcher supplies (kept by the plan)
    calls = _count_validations(monkeypatch)
    kw = {"segments": 3} if schedule == "segments" else {}
    _run(x, **kw)
    first = list(stub_driver)
    assert len(calls) == 1 and first
    for _ in range(2):
        _run(x, **kw)
    assert len(calls) == 1 and len(api._plans) == 1
    n = len(first)
    assert stub_driver[n:2 * n] == first and stub_driver[2 * n:] == first
    assert any(r[0] == "memset" for r in first) == (schedule == "alongside")
    if schedule == "segments":
        assert len(_kernels(first)) == 5


def test_a_replay_keeps_what_it_reads(stub_driver, monkeypatch):
    """The tensors a recorded forward uses beyond the caller's (offsets, the segments' states
    and constants, zeros for A_log and dt_bias) are held by its plan, so emptying the
    launcher's caches frees none of them."""
    for cache in ("_scratches", "_constants", "_seg_offsets"):
        monkeypatch.setattr(api, cache, {})
    x, _ = _with_heads(2)
    x.update(A_log=None, dt_bias=None)
    _run(x, segments=3)
    (plan,) = api._plans.values()
    held = {t.data_ptr() for t in plan.held}
    made = [*api._scratches.values(), *api._constants.values(),
            *(t for pair in api._seg_offsets.values() for t in pair)]
    # the states; zeros for v, A_log and dt_bias, the identities; K1's and the segments'
    # offsets (two tensors each)
    assert len(made) == 9 and all(t.data_ptr() in held for t in made)


CALL_CHANGES = {
    **CHANGES,
    "q-pointer": lambda x: x.update(q=x["q"].clone()),
    "precision": lambda x: x.update(precision="precise",
                                    workspace=torch.empty(1 << 20, dtype=torch.uint8)),
    "segments": lambda x: x.update(segments=2),
    "gate": lambda x: x.update(gate="unbounded"),
    "qk_l2norm": lambda x: x.update(qk_l2norm=False),
    "scale-type": lambda x: x.update(scale=1),  # 1 == 1.0, another type
}


@pytest.mark.parametrize("change", list(CALL_CHANGES))
def test_a_changed_call_is_not_replayed(stub_driver, monkeypatch, change):
    x = _problem()
    x["scale"] = 1.0
    calls = _count_validations(monkeypatch)
    _run(x)
    CALL_CHANGES[change](x)
    _run(x)
    assert len(calls) == 2, change


@pytest.mark.parametrize("switch", ["KDA_CUTE_WY", "KDA_CUTE_ALONGSIDE"])
def test_a_changed_switch_is_not_replayed(stub_driver, monkeypatch, switch):
    x = _problem()
    calls = _count_validations(monkeypatch)
    _run(x)
    monkeypatch.setenv(switch, "0")
    _run(x)
    assert len(calls) == 2


def _with_cu_seqlens(x, cu, dtype=torch.int64):
    x["cu_seqlens"] = torch.tensor(cu, dtype=dtype)
    x["initial_state"] = x["initial_state"].repeat(len(cu) - 1, 1, 1, 1)
    x["final_state"] = torch.empty_like(x["initial_state"])
    x["workspace"] = torch.empty(1 << 20, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
def test_varlen_replay_refills_the_offsets(stub_driver, monkeypatch, dtype):
    """A varlen call with the same tensors replays, its chunk offsets recomputed from the
    call's cu_seqlens values (changed in place here) into the tensors its launches read, and
    those values checked as the full path checks them."""
    x = _problem(T=40)
    _with_cu_seqlens(x, [0, 17, 40], dtype)
    calls = _count_validations(monkeypatch)
    fwd(**x, check_seqlens=True)
    (plan,) = api._plans.values()
    first = list(stub_driver)
    x["cu_seqlens"].copy_(torch.tensor([0, 3, 40]))
    fwd(**x, check_seqlens=True)
    assert len(calls) == 1 and stub_driver[len(first):] == first
    cs, cc = plan.offsets(x["cu_seqlens"])
    assert cs.tolist() == [0, 3, 40] and cc.tolist() == [0, 1, 4]  # s // 16 + s
    assert cc.data_ptr() == plan.offsets.cc.data_ptr()
    x["cu_seqlens"].copy_(torch.tensor([0, 30, 20]))
    with pytest.raises(ValueError, match="cu_seqlens"):
        fwd(**x, check_seqlens=True)


@pytest.mark.parametrize("why", ["no-workspace", "capturing", "switched-off"])
def test_never_replayed(stub_driver, monkeypatch, why):
    """A call without a workspace (allocated each call), a captured call and KDA_CUTE_REPLAY=0
    take the full path every time."""
    x = _problem(T=40)
    if why == "switched-off":
        monkeypatch.setenv("KDA_CUTE_REPLAY", "0")
    elif why == "no-workspace":
        x["workspace"] = None
    else:
        monkeypatch.setattr(api, "_capturing", lambda dev: True)
    calls = _count_validations(monkeypatch)
    for _ in range(3):
        _run(x)
    assert len(calls) == 3 and not any(p.ok for p in api._plans.values())


def test_a_bad_argument_after_a_replayed_call_still_raises(stub_driver):
    x = _problem()
    _run(x)
    _run(x)
    with pytest.raises((TypeError, ValueError), match="scale"):
        _run({**x, "scale": True})
    with pytest.raises(ValueError, match="lower_bound"):
        _run({**x, "lower_bound": -6.0})
    with pytest.raises(TypeError, match="q"):
        _run({**x, "q": x["q"].float()})


def test_clear_caches_forgets_the_recorded_forwards(stub_driver, monkeypatch):
    x = _problem()
    calls = _count_validations(monkeypatch)
    _run(x)
    _run(x)
    api.clear_caches()
    assert not api._plans and not api._constants and not api._seg_offsets
    _run(x)
    assert len(calls) == 2
