"""Golden launch records: what a forward hands the CUDA driver, on a CPU, with the driver faked.

A record lists, in order, every kernel launch (cubin, grid, block, dynamic shared memory, the
programmatic flag, every parameter's bytes), memset and event operation one forward makes. The
bytes are kept as they are, except that each 64-bit word holding an address becomes the tensor
it points into, by role (`@q+0`, `@workspace+4096`, or `@anon3+0` for a tensor the launcher made,
numbered in order of first use), and each TMA descriptor becomes the arguments it was encoded
from. The launcher's own tensors are described by size and, where a torch op wrote them (offsets,
zeros, identities), a digest of their contents.

    python -m tests.launch_record --write   # re-record tests/golden/launches.json

Re-record only for a change meant to alter what is launched, and say so in its commit.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import struct
import sys
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kda_cute.launch import current as kcurrent
from kda_cute.launch import driver as kdriver

GOLDEN = Path(__file__).parent / "golden" / "launches.json"
BF16, F32 = torch.bfloat16, torch.float32
CUBIN_DIR = Path(__file__).resolve().parent.parent / "kda_cute" / "_cubins" / "sm_90a"
ROLES = ("q", "k", "v", "g", "beta", "out", "A_log", "dt_bias", "initial_state", "final_state",
         "cu_seqlens", "state_indices", "output_state_indices", "has_initial_state",
         "checkpoint_state", "checkpoint_offsets", "checkpoint_slots", "checkpoint_first",
         "workspace", "errors")


# ------------------------------------------------------------------------------ the problems
def _rows(B, T, H, D, pad=0):
    """[B, T, H, D] bf16 with token stride H*D + pad (a slice of a wider buffer when pad)."""
    buf = torch.empty(B, T, H * D + pad, dtype=BF16)
    return buf[..., :H * D].unflatten(-1, (H, D))


def _aligned_workspace(nbytes: int) -> torch.Tensor:
    """A uint8 workspace whose base is 256-byte aligned (so the launcher's offsets into it do not
    depend on where the allocator put it)."""
    buf = torch.empty(nbytes + 256, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 256
    return buf[start:start + nbytes]


def make_call(spec: dict) -> dict:
    """fwd's arguments for one problem spec (the kernels do not run: only the states' contents
    matter, where the launcher copies them)."""
    K = spec["K"]
    V = spec.get("V", K)
    H = spec["H"]
    seqlens = spec.get("seqlens")
    if seqlens is not None:
        B, T, N = 1, sum(seqlens), len(seqlens)
    else:
        B, T = spec["B"], spec["T"]
        N = B
    pad = spec.get("pad", 0)
    q, k, g = (_rows(B, T, H, K, pad) for _ in range(3))
    v = _rows(B, T, H, V, pad)
    out = _rows(B, T, H, V, spec.get("out_pad", 0))
    beta = torch.empty(B, T, H, dtype=BF16)
    sdt = {"f32": F32, "bf16": BF16, None: None}
    s_in, s_out = sdt[spec.get("state_in", "f32")], sdt[spec.get("state_out", "f32")]
    # the states' contents may be copied by the launcher (a bf16 state through an fp32 one):
    # fixed values, so those copies' digests are too
    gen = torch.Generator().manual_seed(0)
    s0 = (torch.randn(N, H, V, K, generator=gen).to(s_in) if s_in is not None else None)
    s1 = torch.empty(N, H, V, K, dtype=s_out) if s_out is not None else None
    if spec.get("in_place"):
        s1 = s0
    pool = spec.get("pool")
    extra = {}
    if pool is not None:
        # the pool form: a pool of `slots` slots with `pad` elements between them, in place
        # unless read only
        slots = pool["slots"]
        buf = torch.randn(slots, H * V * K + pool.get("pad", 0), generator=gen).to(s_in)
        s0 = buf[:, :H * V * K].unflatten(-1, (H, V, K))
        s1 = None if pool.get("read_only") else s0
        idt = torch.int64 if pool.get("idx64") else torch.int32
        extra["state_indices"] = torch.arange(N, dtype=idt) % slots
        if pool.get("out"):
            extra["output_state_indices"] = (torch.arange(N, dtype=idt) + 1) % slots
        extra["null_slot"] = pool.get("null_slot")
    if spec.get("has_init"):
        extra["has_initial_state"] = torch.arange(N) % 2 == 0
    ck = spec.get("ckpt")
    if ck is not None:
        # checkpoints: offsets [N, C] into [N, C, H, V, K], or every n tokens into pool slots
        cdt = sdt[ck.get("dtype", "f32")]
        idt = torch.int64 if ck.get("idx64") else torch.int32
        if "every" in ck:
            M = ck["per_row"]
            # slot_pad: a pool whose slot stride is H V K + slot_pad elements
            pad = ck.get("slot_pad", 0)
            cstate = torch.empty(ck["slots"], H * V * K + pad, dtype=cdt)[:, :H * V * K]
            extra.update(checkpoint_state=cstate.view(ck["slots"], H, V, K),
                         checkpoint_slots=torch.arange(N * M, dtype=idt).view(N, M),
                         checkpoint_every=ck["every"],
                         checkpoint_first=torch.full((N,), 30, dtype=idt)
                         if ck.get("first") else None)
        else:
            C = ck["offsets"]
            extra.update(checkpoint_state=torch.empty(N, C, H, V, K, dtype=cdt),
                         checkpoint_offsets=torch.arange(1, N * C + 1, dtype=idt).view(N, C))
    cu = None
    if seqlens is not None:
        offs = [0]
        for n in seqlens:
            offs.append(offs[-1] + n)
        cu = torch.tensor(offs, dtype=torch.int32 if spec.get("cu32") else torch.int64)
    gates = spec.get("gate_params", True)
    # the gate parameters' dtypes (a model cast to bf16 holds them in bf16)
    a_dt, b_dt = spec.get("gate_dtypes", (F32, F32))
    return dict(q=q, k=k, v=v, g=g, beta=beta, scale=K ** -0.5, out=out,
                A_log=torch.empty(H, dtype=a_dt) if gates else None,
                dt_bias=torch.empty(H, K, dtype=b_dt) if gates else None,
                lower_bound=spec.get("lower_bound", -5.0), initial_state=s0, final_state=s1,
                cu_seqlens=cu, **extra)


def problem_of(opts=None, **spec):
    """The Problem of a spec's CPU tensors (B1 T40 H2 K64 by default) under `opts` (None: the
    switches named, alongside on and WY auto, not the environment's)."""
    from kda_cute import Call, Options, checks
    opts = opts or Options(alongside=True, wy="auto")
    spec = {"B": 1, "T": 40, "H": 2, "K": 64, **spec}
    call = make_call(spec)
    return checks.forward(Call(**{n: call.get(n) for n in Call._fields}), opts,
                          check_seqlens=False, cuda=False)


def plan_of(opts=None, **spec):
    """problem_of's plan on an H200."""
    from kda_cute import Options, plans
    opts = opts or Options(alongside=True, wy="auto")
    return plans.plan(problem_of(opts, **spec), opts, plans.H200)


def _kw(spec: dict) -> dict:
    return {n: spec[n] for n in ("gate", "qk_l2norm", "beta_sigmoid", "segments", "precision")
            if n in spec}


# name -> spec: every schedule (serial, WY, alongside, segments, varlen longest first, several
# sequences per K2 CTA), each head dim and precision, gate forms, states, strides, options
PROBLEMS = {
    "k64-serial-short": dict(B=1, T=40, H=2, K=64),
    "k64-precise": dict(B=2, T=100, H=4, K=64, precision="precise"),
    "k128-serial-many-heads": dict(B=1, T=200, H=96, K=128),
    "k128-wy-one-cta-per-sm": dict(B=1, T=200, H=64, K=128),
    "k128-precise-h64": dict(B=1, T=200, H=64, K=128, precision="precise"),
    "k256-wy": dict(B=1, T=100, H=16, K=256),
    "k256-precise": dict(B=1, T=100, H=16, K=256, precision="precise"),
    "k64-alongside": dict(B=1, T=512, H=2, K=64),
    "k128-alongside-h32": dict(B=1, T=8192, H=32, K=128),
    "k256-alongside": dict(B=1, T=1024, H=4, K=256),
    "k128-alongside-precise": dict(B=1, T=4096, H=32, K=128, precision="precise"),
    "k128-segments-auto-h16": dict(B=1, T=8192, H=16, K=128),
    "k256-segments-auto": dict(B=1, T=8192, H=4, K=256),
    "k64-segments-3": dict(B=1, T=40, H=2, K=64, segments=3),
    "k64-segments-bf16-states": dict(B=2, T=100, H=2, K=64, segments=3, state_in="bf16",
                                     state_out="bf16"),
    "k128-segments-no-states": dict(B=1, T=300, H=2, K=128, segments=4, state_in=None,
                                    state_out=None),
    "k128-batch-seqs-per-cta": dict(B=32, T=256, H=32, K=128),
    "k256-batch-seqs-per-cta": dict(B=8, T=1024, H=32, K=256),
    "k64-varlen-longest-first": dict(seqlens=[40, 7, 90, 33, 5, 120], H=64, K=64),
    "k64-varlen-one-wave": dict(seqlens=[40, 7, 90, 33, 5, 120], H=2, K=64, cu32=True),
    "k64-varlen-160-seqs": dict(seqlens=[3] * 160, H=2, K=64),
    "k128-varlen-segments-auto": dict(seqlens=[8192], H=16, K=128),
    "k128-varlen-segments-3": dict(seqlens=[300, 0, 777, 5], H=2, K=128, segments=3),
    "k128-varlen-empty-seqs": dict(seqlens=[300, 0, 1700, 0], H=4, K=128, cu32=True),
    "k128-varlen-mix-h64": dict(seqlens=[2048, 512, 3000, 100, 2532], H=64, K=128),
    "k128-gate-unbounded": dict(B=1, T=64, H=4, K=128, gate="unbounded"),
    "k128-gate-none-no-params": dict(B=1, T=64, H=4, K=128, gate="none", gate_params=False),
    "k128-gate-params-bf16-f16": dict(B=1, T=64, H=4, K=128, gate="unbounded",
                                      gate_dtypes=(BF16, torch.float16)),
    "k64-prenormed": dict(B=1, T=50, H=3, K=64, qk_l2norm=False, beta_sigmoid=False,
                          lower_bound=-1.5),
    "k128-strided-rows": dict(B=1, T=64, H=4, K=128, pad=64, out_pad=8),
    "k128-in-place-bf16": dict(B=2, T=64, H=4, K=128, state_in="bf16", in_place=True),
    "k128-no-initial-state": dict(B=1, T=64, H=4, K=128, state_in=None),
    "k64-no-final-state": dict(B=1, T=64, H=4, K=64, state_out=None),
    "k128-simt": dict(B=1, T=64, H=4, K=128, config=("SIMT", 128)),
    "k128-chunk32": dict(B=1, T=100, H=4, K=128, config=("EXPERIMENTAL", 128)),
    "k128-alongside-off": dict(B=1, T=8192, H=32, K=128, alongside=False),
    "k128-wy-off": dict(B=1, T=200, H=64, K=128, wy="off"),
    "k128-wy-force": dict(B=1, T=200, H=96, K=128, wy="force"),
    "k64-empty-batch": dict(B=1, T=0, H=2, K=64),
    # the pool form, dense has_initial_state
    "k128-varlen-pool": dict(seqlens=[300, 0, 1700, 5], H=4, K=128, pool=dict(slots=9, pad=8)),
    "k128-varlen-pool-int64-out-null": dict(seqlens=[40, 7, 90], H=4, K=128, has_init=True,
                                            pool=dict(slots=5, idx64=True, out=True,
                                                      null_slot=0)),
    "k64-pool-read-only-bf16": dict(B=3, T=64, H=4, K=64, state_in="bf16",
                                    pool=dict(slots=4, read_only=True)),
    "k128-pool-segments-bf16": dict(B=2, T=300, H=2, K=128, segments=3, state_in="bf16",
                                    has_init=True, pool=dict(slots=6, pad=16, out=True)),
    "k128-pool-alongside": dict(seqlens=[4096, 2048], H=8, K=128, pool=dict(slots=3)),
    "k128-pool-wy": dict(B=1, T=200, H=64, K=128, pool=dict(slots=2)),
    "k128-pool-simt": dict(B=2, T=64, H=4, K=128, config=("SIMT", 128), pool=dict(slots=3)),
    "k128-dense-has-init": dict(B=3, T=64, H=4, K=128, has_init=True),
    "k64-k1-grid-z": dict(B=1, T=16 * 70000, H=1, K=64),
    # checkpoints: both forms, every schedule
    "k128-ckpt-offsets-serial": dict(B=2, T=300, H=64, K=128, ckpt=dict(offsets=3)),
    "k128-ckpt-offsets-bf16-alongside": dict(B=1, T=8192, H=32, K=128,
                                             ckpt=dict(offsets=2, dtype="bf16", idx64=True)),
    "k128-ckpt-offsets-segments": dict(B=1, T=8192, H=16, K=128, ckpt=dict(offsets=4)),
    "k64-ckpt-every-pool-varlen": dict(seqlens=[300, 0, 1700, 5], H=4, K=64,
                                       pool=dict(slots=9, null_slot=0),
                                       ckpt=dict(every=64, per_row=30, slots=130, first=True,
                                                 dtype="bf16")),
    "k256-ckpt-every-precise": dict(B=2, T=256, H=8, K=256, precision="precise",
                                    ckpt=dict(every=128, per_row=2, slots=4, idx64=True)),
    # the tensor maps of a pool with a free slot stride (fp32 and bf16 destinations)
    "k128-ckpt-every-strided-pool": dict(B=2, T=300, H=4, K=128,
                                         ckpt=dict(every=64, per_row=4, slots=12, first=True,
                                                   slot_pad=40)),
    "k64-ckpt-every-strided-pool-bf16": dict(B=2, T=300, H=4, K=64,
                                             ckpt=dict(every=64, per_row=4, slots=12,
                                                       first=True, slot_pad=24, dtype="bf16")),
}


def config_of(spec: dict):
    if "config" not in spec:
        return None
    from kda_cute import ladder
    group, d = spec["config"]
    return next(c for c in getattr(ladder, group) if c.prep.head_dim_k == d)


# ----------------------------------------------------------------------------- a fake driver
class FakeDriver(kdriver.StandIn):
    """The parts of cuda.bindings.driver the launcher calls, recording instead of running."""

    def __init__(self):
        self.ops: list = []
        self.maps: list = []  # the encoded descriptors' arguments, by id
        self._keep: list = []
        self._cubins = {}
        for path in sorted(CUBIN_DIR.glob("*.cubin")):
            data = path.read_bytes()
            man = json.loads(path.with_suffix(".json").read_text())
            self._cubins[data] = (path.stem, [p[2] for p in man["params"]])
        self._libs, self._funcs = {}, {}

    # errors, streams, events
    def cuGetErrorString(self, err):  # noqa: N802 (the driver's names)
        return 0, b"fake"

    def cuEventCreate(self, flags):  # noqa: N802
        self._events = getattr(self, "_events", 0) + 1  # a handle of its own each
        return 0, 1000 + self._events

    def cuEventRecord(self, ev, stream):  # noqa: N802
        self.ops.append({"op": "event_record", "stream": stream})
        return (0,)

    def cuStreamCreate(self, flags):  # noqa: N802
        self._streams = getattr(self, "_streams", 0) + 1
        return 0, 2000 + self._streams

    def cuCtxGetStreamPriorityRange(self):  # noqa: N802
        return 0, 0, -5

    def cuStreamCreateWithPriority(self, flags, priority):  # noqa: N802
        # (a stream of the greatest priority: 3000 + its number)
        self._streams = getattr(self, "_streams", 0) + 1
        return 0, (3000 if priority == -5 else 2000) + self._streams

    def cuStreamWaitEvent(self, stream, ev, flags):  # noqa: N802
        self.ops.append({"op": "event_wait", "stream": stream})
        return (0,)

    # modules and functions
    def cuLibraryLoadData(self, addr, *rest):  # noqa: N802
        image = ctypes.string_at(addr, kdriver.image_size(addr))
        lib = len(self._libs) + 1
        self._libs[lib] = self._cubins[image]
        return 0, lib

    def cuFuncSetAttribute(self, f, attr, value):  # noqa: N802
        return (0,)

    # launches and memsets
    def _params(self, f, addr):
        name, sizes = self._libs[f]
        ptrs = (ctypes.c_void_p * len(sizes)).from_address(addr)
        return name, [ctypes.string_at(ptrs[i], n) for i, n in enumerate(sizes)]

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, addr, extra):  # noqa: N802
        name, params = self._params(f, addr)
        self.ops.append({"op": "launch", "kernel": name, "grid": [gx, gy, gz],
                         "block": [bx, by, bz], "smem": smem, "programmatic": False,
                         "stream": stream, "params": params})
        return (0,)

    def cuLaunchKernelEx(self, conf, f, addr, extra):  # noqa: N802
        name, params = self._params(f, addr)
        prog = any(getattr(a.value, "programmaticStreamSerializationAllowed", 0)
                   for a in conf.attrs[:conf.numAttrs])
        self.ops.append({"op": "launch", "kernel": name,
                         "grid": [conf.gridDimX, conf.gridDimY, conf.gridDimZ],
                         "block": [conf.blockDimX, conf.blockDimY, conf.blockDimZ],
                         "smem": conf.sharedMemBytes, "programmatic": bool(prog),
                         "stream": conf.hStream, "params": params})
        return (0,)

    def cuMemsetD32Async(self, ptr, value, count, stream):  # noqa: N802
        self.ops.append({"op": "memset_d32", "ptr": int(ptr), "value": value, "count": count,
                         "stream": stream})
        return (0,)

    def cuTensorMapEncodeTiled(self, dt, rank, ptr, dims, strides, box, elem, il, swz, l2,  # noqa: N802
                               oob):
        i = len(self.maps)
        self.maps.append({"dtype": dt, "rank": rank, "ptr": int(ptr), "dims": list(dims),
                          "row_stride_bytes": list(strides), "box": list(box),
                          "swizzle": swz})
        buf = ctypes.create_string_buffer(b"FAKETMAP" + struct.pack("<Q", i) + bytes(112), 128)
        self._keep.append(buf)
        return 0, kdriver.Namespace(getPtr=lambda b=buf: ctypes.addressof(b))


_DRIVER: list = []


def driver() -> FakeDriver:
    """The process's fake driver: the launcher keeps loaded kernels and encoded descriptors
    across calls, so one fake serves them all."""
    if not _DRIVER:
        _DRIVER.append(FakeDriver())
    return _DRIVER[0]


# -------------------------------------------------------------- the launcher's own tensors
_EMPTY = {"empty.memory_format", "empty_strided.default", "empty_like.default",
          "new_empty.default", "new_empty_strided.default"}


class _Made(TorchDispatchMode):
    """Every storage a torch op makes or writes while active: storage address -> (bytes, whether
    a torch op defined its contents)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, list] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__ if hasattr(func, "__name__") else str(func)
        written = [a for a, s in zip(args, func._schema.arguments, strict=False)
                   if s.alias_info is not None and s.alias_info.is_write
                   and isinstance(a, torch.Tensor)]
        written += [v for k, v in kwargs.items() if k == "out" and isinstance(v, torch.Tensor)]
        for t in written:
            self._note(t, True)
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self._note(t, name not in _EMPTY, new_only=True)
        return out

    def _note(self, t: torch.Tensor, defined: bool, new_only: bool = False) -> None:
        st = t.untyped_storage()
        key = st.data_ptr()
        if key in self.storages:
            if not new_only:
                self.storages[key][1] |= defined
            return
        self.storages[key] = [st, defined]


# --------------------------------------------------------------------------- normalisation
class _Names:
    """Addresses -> `@role+offset`: the call's tensors first (by their own base, then by the
    range they span), then the storages torch ops made during the call (anonN, in order of
    first use)."""

    def __init__(self, call: dict, made: _Made):
        self.spans = []
        for role in ROLES:
            t = call.get(role)
            if isinstance(t, torch.Tensor):
                extent = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(),
                                                                strict=True))
                          if t.numel() else 0) * t.element_size()
                self.spans.append((role, t.data_ptr(), max(extent, 1)))
        self.made = made
        self.anon: dict[int, str] = {}

    def __call__(self, p: int) -> str | None:
        for role, base, _ in self.spans:
            if p == base:
                return f"@{role}+0"
        for role, base, n in self.spans:
            if base <= p < base + n:
                return f"@{role}+{p - base}"
        for key, (st, _) in self.made.storages.items():
            if key <= p < key + max(st.nbytes(), 1):
                label = self.anon.setdefault(key, f"anon{len(self.anon)}")
                return f"@{label}+{p - key}"
        return None

    def anon_table(self) -> dict:
        out = {}
        for key, label in self.anon.items():
            st, defined = self.made.storages[key]
            data = (torch.empty(0, dtype=torch.uint8).set_(st).numpy().tobytes()
                    if defined else None)
            out[label] = {"bytes": st.nbytes(),
                          "contents": (None if data is None else data.hex() if len(data) <= 64
                                       else "sha256:" + hashlib.sha256(data).hexdigest()[:32])}
        return out


def _words(blob: bytes, names: _Names, maps: list) -> str:
    if len(blob) == 128 and blob[:8] == b"FAKETMAP":
        m = dict(maps[struct.unpack_from("<Q", blob, 8)[0]])
        m["ptr"] = names(m["ptr"]) or hex(m["ptr"])
        return "tma" + json.dumps(m, sort_keys=True)
    if len(blob) % 8:
        return blob.hex()
    out = []
    for i in range(0, len(blob), 8):
        w = blob[i:i + 8]
        label = names(struct.unpack("<Q", w)[0])
        out.append(label or w.hex())
    return " ".join(out)


def normalise(ops: list, maps: list, names: _Names) -> list:
    """The operations with addresses as tensor roles and streams other than the call's (0) as
    their kind and order of first use in the record (the fake driver numbers the streams of
    the whole process, so raw handles would depend on the tests run before)."""
    rec, streams = [], {}
    for op in ops:
        op = dict(op)
        st = op.get("stream")
        if st:
            kind = "high" if st >= 3000 else "side"
            if st not in streams:
                streams[st] = f"{kind} {sum(v.startswith(kind) for v in streams.values()) + 1}"
            op["stream"] = streams[st]
        if op["op"] == "launch":
            op["params"] = [_words(b, names, maps) for b in op["params"]]
        elif op["op"] == "memset_d32":
            op["ptr"] = names(op["ptr"]) or hex(op["ptr"])
        rec.append(op)
    return rec


# ---------------------------------------------------------------------------- the recording
class _Props:
    multi_processor_count = 132
    shared_memory_per_multiprocessor = 233472
    shared_memory_per_block_optin = 232448
    name = "fake H200"


@contextmanager
def fake_device(monkeypatch):
    """torch.cuda (and kda_cute.launch.current) as an H200 on device 0 would answer, stream 0,
    never capturing (torch's device and stream contexts do nothing)."""
    class _Dev:
        def __init__(self, *a):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: _Props())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda *a: kdriver.Namespace(cuda_stream=0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", _Dev)
    monkeypatch.setattr(torch.cuda, "stream", _Dev)
    # what the launcher reads of them without torch.cuda's wrappers (kda_cute.launch.current)
    monkeypatch.setattr(kcurrent, "device", lambda: 0)
    monkeypatch.setattr(kcurrent, "stream", lambda device: 0)
    monkeypatch.setattr(kcurrent, "capturing", lambda: False)
    yield


def _options(spec: dict):
    from kda_cute import checks
    return checks.options(
        gate=spec.get("gate", "bounded"), qk_l2norm=spec.get("qk_l2norm", True),
        beta_sigmoid=spec.get("beta_sigmoid", True), segments=spec.get("segments"),
        config=config_of(spec), precision=spec.get("precision", "fast"),
        alongside=spec.get("alongside", True), wy=spec.get("wy", "auto"))


def _plan(spec: dict, call: dict):
    """The checks and the plan of a problem, on an H200 (the tensors live on the CPU)."""
    from kda_cute import Call, checks, plans
    c = Call(**{n: call.get(n) for n in Call._fields})
    opts = _options(spec)
    p = checks.forward(c, opts, check_seqlens=False, cuda=False)
    return c, plans.plan(p, opts, plans.H200)


def _launch(spec: dict, call: dict, ws: torch.Tensor, drv: FakeDriver) -> str:
    """Run one forward through the launcher with the fake driver; returns its schedule."""
    from kda_cute import api, launch
    api.clear_caches()
    c, pl = _plan(spec, call)
    # (no event wait for an earlier test's alongside forward: the substitution starts with no
    # stream order)
    with kdriver.substitute(drv):
        launch.run(pl, c, ws)
    return str(pl.schedule)


def _workspace_for(spec: dict, call: dict) -> torch.Tensor:
    return _aligned_workspace(_plan(spec, call)[1].workspace_bytes)


def record(name: str, monkeypatch) -> dict:
    """One problem's golden record: its schedule, its driver operations, the launcher's own
    tensors they use."""
    spec = PROBLEMS[name]
    drv = driver()
    drv.ops = []
    with fake_device(monkeypatch):
        call = make_call(spec)
        # the error words: a CPU tensor in place of the page-locked one (no CUDA here)
        call["errors"] = torch.zeros(8, dtype=torch.int32)
        from kda_cute import errors
        monkeypatch.setattr(errors, "address", lambda dev: call["errors"].data_ptr())
        ws = _workspace_for(spec, call)
        call["workspace"] = ws
        made = _Made()
        with made:
            sched = _launch(spec, call, ws, drv)
        names = _Names(call, made)
        ops = normalise(drv.ops, drv.maps, names)
    return {"schedule": sched, "ops": ops, "anon": names.anon_table()}


def counting(monkeypatch, module, name) -> list:
    """`module.name` (a public function) wrapped to count its calls: the list grows by one a
    call."""
    calls = []
    real = getattr(module, name)

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(module, name, counted)
    return calls


class _Patch:
    """A minimal monkeypatch for running outside pytest."""

    def __init__(self):
        self.undo = []

    def setattr(self, obj, name, value):
        self.undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    def restore(self):
        for obj, name, value in reversed(self.undo):
            setattr(obj, name, value)
        self.undo = []


def record_all() -> dict:
    out = {}
    for name in PROBLEMS:
        mp = _Patch()
        try:
            out[name] = record(name, mp)
        finally:
            mp.restore()
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", action="store_true", help=f"write {GOLDEN}")
    a = ap.parse_args(argv)
    recs = record_all()
    text = json.dumps(recs, indent=1, sort_keys=True) + "\n"
    if a.write:
        GOLDEN.parent.mkdir(parents=True, exist_ok=True)
        GOLDEN.write_text(text)
        print(f"wrote {len(recs)} records ({len(text)} bytes) to {GOLDEN}")
    else:
        for name, r in recs.items():
            kernels = [o.get("kernel", o["op"]) for o in r["ops"]]
            print(f"{name:<28} {r['schedule']:<11} {' '.join(kernels)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
