"""One forward's launches as a C header, for a runtime that has only the CUDA driver API.

    kda-cute plan --out DIR --B 1 --T 1000 --H 4 --K 128    (or python -m kda_cute.plan_export)

`export_plan(out_dir, B=, T=, H=, K=, ...)` writes `kda_cute_plan.h` beside what `kda-cute
export` writes (the cubins and `kda_cute_kernels.h`, which it includes): the buffers the runtime
provides (the call's tensors by role, with their byte sizes and layouts; the workspace; the
device error words; the launcher's own small tensors, constants with their bytes), then the
operations of one forward in order: 32-bit memsets (buffer, byte offset, value, count) and
kernel launches (a kernel of kda_cute_kernels.h, grid, block, dynamic shared memory, the
programmatic flag, and a recipe for each parameter: literal bytes; a buffer's address plus an
offset, written over the first 8 bytes; or a TMA descriptor to encode with
cuTensorMapEncodeTiled from a buffer's address plus an offset, dtype, dims, row stride, box and
swizzle). examples/cpp/kda_forward.cpp runs such a header.

How: the forward's plan runs through the Python launcher (kda_cute.launch.run) on the CPU, the
tensors CPU ones that nothing reads, with the CUDA driver replaced by a recorder
(launch.driver.substitute), so the header holds exactly what the launcher would hand the
driver; each address is then mapped back to the buffer it points into. What the header cannot
say (events between streams, torch-side copies, an address in no known buffer, driver options
the runtime does not mirror) raises PlanExportError naming it.

One problem, one schedule: fixed-length batches with fp32 initial and final states (either may
be left out), one stream. K2 never runs alongside K1 (the alongside schedule orders two streams
with events) nor over segments; wy="off" (the default) takes the serial K2 in the alongside
builds' arithmetic, so the result is bit-identical to `kda_cute.fwd`'s default schedule where
that one is alongside (tests/test_forward.py checks the two agree). scale and lower_bound
are baked into the parameter bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import struct
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from . import abi, checks, errors, launch, plans
from .abi import c_ident  # the identifiers kda_cute_kernels.h gives its kernels
from .cubin import load_manifest
from .launch import driver as kdriver
from .plans.steps import Copy, Launch, Memset
from .plans.workspace import ALIGN
from .problem import Call
from .specs import args_for
from .specs.step import ERRORS

HEADER = "kda_cute_plan.h"
ARCH = "sm_90a"
# the call's tensors a plan may read or write, in Call order, and whether the forward reads or
# writes them
ROLES = {"q": "input", "k": "input", "v": "input", "g": "input", "beta": "input",
         "out": "output", "A_log": "input", "dt_bias": "input", "initial_state": "input",
         "final_state": "output"}
BUFFER_KINDS = ("input", "output", "workspace", "errors", "constant", "scratch")
# what launch.driver.encode_tiled passes for every descriptor; the runtime passes the same, so a
# change there must be a change here (the recorder refuses anything else)
TMA_FIXED = {"interleave": "CU_TENSOR_MAP_INTERLEAVE_NONE",
             "l2": "CU_TENSOR_MAP_L2_PROMOTION_L2_128B",
             "oob": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE", "element_strides": [1, 1]}
TMA_DTYPES = {"bfloat16": "KDA_TMA_BFLOAT16", "float16": "KDA_TMA_FLOAT16",
              "float32": "KDA_TMA_FLOAT32"}
MAX_RANK = 5  # the buffer table's shape arrays


class PlanExportError(Exception):
    """The forward does something kda_cute_plan.h cannot express."""


# ------------------------------------------------------------------------------- the plan
@dataclass(frozen=True)
class PlanBuffer:
    """A device buffer the runtime provides. kind: "input" (the caller fills it), "output"
    (the forward writes it), "workspace" (any contents; its base aligned to ALIGN),
    "errors" (zeros before the forward; a word set after it names a bad value: ERRORS),
    "constant" (`contents`, uploaded once), "scratch" (any contents, written and read within
    the forward). shape and stride in elements."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int
    contents: bytes | None = None


@dataclass(frozen=True)
class Address:
    """`offset` bytes into buffer `buffer` (an index into ExportedPlan.buffers)."""

    buffer: int
    offset: int


@dataclass(frozen=True)
class Tma:
    """A CUtensorMap to encode (launch.driver.encode_tiled's arguments, rank 2): dims and box
    innermost first, in elements; the row stride in bytes; the smem swizzle span in bytes."""

    at: Address
    dtype: str
    dims: tuple[int, int]
    row_stride_bytes: int
    box: tuple[int, int]
    swizzle: int


@dataclass(frozen=True)
class Param:
    """One kernel parameter (abi.params' order and roles): `literal` bytes (its size), with the
    first 8 replaced by the address of `address` where given; or the descriptor `tma`."""

    arg: str
    role: str
    size: int
    literal: bytes = b""
    address: Address | None = None
    tma: Tma | None = None


@dataclass(frozen=True)
class MemsetOp:
    """cuMemsetD32Async: `count` 32-bit words at `at` set to `value`."""

    name: str
    at: Address
    value: int
    count: int


@dataclass(frozen=True)
class LaunchOp:
    """A kernel launch: the cubin `kernel` (a name of kda_cute_kernels.h), its grid and block,
    the dynamic shared memory to launch with (and to allow the function first), whether it is
    the programmatic dependent of the stream's previous kernel, and each parameter's recipe."""

    name: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    programmatic: bool
    params: tuple[Param, ...]


@dataclass(frozen=True)
class ExportedPlan:
    """One forward as a runtime replays it: its sizes and options, the schedule, the buffers
    and the operations in order (`header()` is the C text)."""

    problem: dict
    describe: str
    workspace_bytes: int
    buffers: tuple[PlanBuffer, ...]
    ops: tuple[MemsetOp | LaunchOp, ...]

    def buffer(self, name: str) -> PlanBuffer:
        (b,) = [b for b in self.buffers if b.name == name]
        return b

    def header(self) -> str:
        return header(self)


# ---------------------------------------------------------------------- the driver recorder
_TMA_MARK = b"KDAPLAN-TMA"


class _Recorder(kdriver.StandIn):
    """The parts of cuda.bindings.driver that kda_cute.launch.driver calls, recording the
    launches and memsets instead of running them. `images`: cubin bytes -> kernel name (the
    plan's kernels)."""

    def __init__(self, images: dict[bytes, str]):
        self.images = images
        self.ops: list[dict] = []
        self.maps: list[dict] = []  # each encoded descriptor's arguments
        self.kernels: dict[int, str] = {}  # library / kernel / function handle -> kernel name
        self.allowed: dict[int, int] = {}  # function -> dynamic smem allowed
        self._keep: list = []

    def cuGetErrorString(self, err):  # noqa: N802 (the driver's names)
        return 0, b"recorded, not run"

    def _no_events(self, *a):
        raise PlanExportError("the forward orders streams with CUDA events (the alongside "
                              "schedule, or steps on a side stream), which kda_cute_plan.h "
                              "cannot express: export with K2 serial, without segments")

    cuEventCreate = cuEventRecord = cuStreamWaitEvent = cuStreamCreate = _no_events  # noqa: N815
    cuStreamCreateWithPriority = cuCtxGetStreamPriorityRange = _no_events  # noqa: N815

    def cuLibraryLoadData(self, addr, *rest):  # noqa: N802
        name = self.images.get(ctypes.string_at(addr, kdriver.image_size(addr)))
        if name is None:
            raise PlanExportError("the launcher loaded a cubin that is none of the plan's "
                                  "kernels")
        self.kernels[len(self.kernels) + 1] = name
        return 0, len(self.kernels)

    def cuFuncSetAttribute(self, f, attr, value):  # noqa: N802
        if attr != "CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES":
            raise PlanExportError(f"{self.kernels[f]}: function attribute {attr} is not one "
                                  f"kda_cute_plan.h sets")
        self.allowed[f] = int(value)
        return (0,)

    def _launch(self, f, grid, block, smem, addr, programmatic):
        name = self.kernels[f]
        if smem > self.allowed.get(f, 0):
            raise PlanExportError(f"{name}: launched with {smem} bytes of dynamic shared "
                                  f"memory, allowed {self.allowed.get(f, 0)}")
        sizes = [p[2] for p in load_manifest(name, ARCH)[0]["params"]]
        ptrs = (ctypes.c_void_p * len(sizes)).from_address(addr)
        self.ops.append({"op": "launch", "kernel": name, "grid": tuple(map(int, grid)),
                         "block": tuple(map(int, block)), "smem": int(smem),
                         "programmatic": programmatic,
                         "params": [ctypes.string_at(ptrs[i], n) for i, n in enumerate(sizes)]})
        return (0,)

    def cuLaunchKernel(self, f, gx, gy, gz, bx, by, bz, smem, stream, addr, extra):  # noqa: N802
        if extra:
            raise PlanExportError(f"{self.kernels[f]}: launched with `extra` options")
        return self._launch(f, (gx, gy, gz), (bx, by, bz), smem, addr, False)

    def cuLaunchKernelEx(self, conf, f, addr, extra):  # noqa: N802
        if extra:
            raise PlanExportError(f"{self.kernels[f]}: launched with `extra` options")
        for a in conf.attrs[:conf.numAttrs]:
            if (a.id != "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"
                    or getattr(a.value, "programmaticStreamSerializationAllowed", 0) != 1):
                raise PlanExportError(f"{self.kernels[f]}: launch attribute {a.id} is not one "
                                      f"kda_cute_plan.h expresses")
        return self._launch(f, (conf.gridDimX, conf.gridDimY, conf.gridDimZ),
                            (conf.blockDimX, conf.blockDimY, conf.blockDimZ),
                            conf.sharedMemBytes, addr, conf.numAttrs > 0)

    def cuMemsetD32Async(self, ptr, value, count, stream):  # noqa: N802
        self.ops.append({"op": "memset_d32", "ptr": int(ptr), "value": int(value),
                         "count": int(count)})
        return (0,)

    def cuTensorMapEncodeTiled(self, dt, rank, ptr, dims, strides, box, elem, il, swz,  # noqa: N802
                               l2, oob):
        fixed = {"interleave": il, "l2": l2, "oob": oob, "element_strides": list(elem)}
        if rank != 2 or fixed != TMA_FIXED:
            raise PlanExportError(f"a TMA descriptor of rank {rank} with {fixed}: "
                                  f"kda_cute_plan.h expresses rank 2 with {TMA_FIXED}")
        self.maps.append({"dtype": dt, "ptr": int(ptr), "dims": tuple(dims),
                          "row_stride_bytes": int(strides[0]), "box": tuple(box),
                          "swizzle": int(swz)})
        mark = _TMA_MARK + struct.pack("<Q", len(self.maps) - 1)
        buf = ctypes.create_string_buffer(mark + bytes(128 - len(mark)), 128)
        self._keep.append(buf)
        return 0, kdriver.Namespace(getPtr=lambda b=buf: ctypes.addressof(b))


# ------------------------------------------------------------------- running it on the CPU
_lock = threading.Lock()


@contextlib.contextmanager
def _on_the_cpu(error_words: torch.Tensor, taken: dict):
    """launch.run on CPU tensors: torch.cuda answers as device 0 with stream 0 and no capture
    (its device context does nothing), the device error words are `error_words`, and each
    launcher buffer the run takes is noted in `taken` (Buffer -> tensor). Everything is put
    back on exit; the lock keeps two exports from interleaving (a forward on a GPU meanwhile,
    in another thread, would see the stand-ins: export where nothing else runs)."""
    real_get = launch.buffers.get

    def get(b, dev, stream):
        t = taken[b] = real_get(b, dev, stream)
        return t

    patches = [(torch.cuda, "device", contextlib.nullcontext),
               (torch.cuda, "current_device", lambda: 0),
               (torch.cuda, "current_stream", lambda *a: kdriver.Namespace(cuda_stream=0)),
               (torch.cuda, "is_current_stream_capturing", lambda: False),
               (launch.current, "device", lambda: 0),
               (launch.current, "stream", lambda device: 0),
               (launch.current, "capturing", lambda: False),
               (errors, "address", lambda dev: error_words.data_ptr()),
               (launch.buffers, "get", get)]
    with _lock:
        saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
        try:
            for obj, name, value in patches:
                setattr(obj, name, value)
            yield
        finally:
            for obj, name, value in saved:
                setattr(obj, name, value)


def _aligned(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` whose base is ALIGN-aligned (the launcher's workspace offsets
    are from the aligned base: with this one they are from the tensor's start)."""
    buf = torch.empty(nbytes + ALIGN, dtype=torch.uint8)
    start = (-buf.data_ptr()) % ALIGN
    return buf[start:start + nbytes]


def _extent(t: torch.Tensor) -> int:
    """The bytes a tensor spans, from its first element to past its last."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
            ) * t.element_size()


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _buffer_name(b, used: set) -> str:
    """A launcher buffer's name: its kind and what it is for (segments_cu_chunks,
    scratch_rescale), numbered where two would share one."""
    words = [b.kind] + [str(p) for p in b.params if isinstance(p, str)]
    name = c_ident("_".join(words))
    n, i = name, 1
    while n in used:
        n, i = f"{name}{i}", i + 1
    used.add(n)
    return n


class _Spans:
    """Addresses -> Address: the buffers by their base first (a pointer to a buffer's start is
    that buffer's, also where another ends there), then by the bytes they span."""

    def __init__(self):
        self.spans: list[tuple[int, int, int]] = []  # (index, base, bytes)

    def add(self, index: int, t: torch.Tensor) -> None:
        self.spans.append((index, t.data_ptr(), max(_extent(t), 1)))

    def __call__(self, p: int, what: str) -> Address:
        for i, base, _ in self.spans:
            if p == base:
                return Address(i, 0)
        for i, base, n in self.spans:
            if base <= p < base + n:
                return Address(i, p - base)
        raise PlanExportError(f"{what}: address {p:#x} is in none of the plan's buffers")


def _record(call: Call, opts, problem: dict) -> ExportedPlan:
    """Run the forward of `call` (CPU tensors) under `opts` through the launcher with the driver
    recorded, and map what it handed the driver to buffers."""
    p = checks.forward(call, opts, check_seqlens=False, cuda=False)
    plan = plans.plan(p, opts, plans.H200)
    for s in plan.steps:
        if isinstance(s, Copy):
            raise PlanExportError(f"step {s.name!r} is a torch-side copy, which "
                                  f"kda_cute_plan.h cannot express")
    if plan.alongside:
        raise PlanExportError(f"schedule {plan.schedule}: K2 alongside K1 needs two streams "
                              f"ordered by events, which kda_cute_plan.h cannot express")
    images = {}
    for s in plan.launches():
        images[load_manifest(s.kernel.name, ARCH)[1].read_bytes()] = s.kernel.name
    ws = _aligned(plan.workspace_bytes)
    error_words = torch.zeros(len(ERRORS), dtype=torch.int32)
    taken: dict = {}
    rec = _Recorder(images)
    with _on_the_cpu(error_words, taken), kdriver.substitute(rec):
        launch.run(plan, call, ws)
    buffers, spans = _buffers(call, ws, error_words, taken)
    return ExportedPlan({**problem, "schedule": str(plan.schedule)}, plan.describe(),
                        plan.workspace_bytes, buffers, _operations(plan, rec, spans))


def _buffers(call: Call, ws, error_words, taken: dict) -> tuple[tuple[PlanBuffer, ...], _Spans]:
    """The buffers a run used: the call's tensors, the workspace, the error words, the
    launcher's own (in order of first use); and their spans, to map addresses back."""
    buffers: list[PlanBuffer] = []
    spans = _Spans()

    def add(name, kind, t, contents=None):
        spans.add(len(buffers), t)
        buffers.append(PlanBuffer(name, kind, _dtype(t), tuple(t.shape), tuple(t.stride()),
                                  _extent(t), contents))

    for role, kind in ROLES.items():
        t = getattr(call, role)
        if t is not None:
            add(role, kind, t)
    add("workspace", "workspace", ws)
    add("errors", "errors", error_words)
    used = {b.name for b in buffers}
    for b, t in taken.items():
        if t.dim() > MAX_RANK or not t.is_contiguous():
            raise PlanExportError(f"launcher buffer {b}: expected a contiguous tensor of rank "
                                  f"<= {MAX_RANK}")
        if b.kind == "scratch":
            add(_buffer_name(b, used), "scratch", t)
        else:  # made by torch ops, never written: its bytes are its contents
            add(_buffer_name(b, used), "constant", t,
                t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return tuple(buffers), spans


def _operations(plan, rec: _Recorder, spans: _Spans) -> tuple[MemsetOp | LaunchOp, ...]:
    """The recorded driver calls as operations, each one of the plan's steps in order (one
    stream: nothing reorders them)."""
    steps = [s for s in plan.steps if isinstance(s, (Launch, Memset))]
    if len(steps) != len(rec.ops):
        raise PlanExportError(f"the plan has {len(steps)} launches and memsets, the launcher "
                              f"made {len(rec.ops)} driver calls")
    ops = []
    for s, op in zip(steps, rec.ops, strict=True):
        if isinstance(s, Memset):
            if op["op"] != "memset_d32":
                raise PlanExportError(f"step {s.name!r}: expected a memset, got {op['op']}")
            ops.append(MemsetOp(s.name, spans(op["ptr"], f"memset {s.name!r}"), op["value"],
                                op["count"]))
            continue
        if op["op"] != "launch" or op["kernel"] != s.kernel.name:
            raise PlanExportError(f"step {s.name!r}: expected a launch of {s.kernel.name}, "
                                  f"got {op.get('kernel', op['op'])}")
        ops.append(LaunchOp(s.name, op["kernel"], op["grid"], op["block"], op["smem"],
                            op["programmatic"], _params(s, op, rec.maps, spans)))
    return tuple(ops)


def _params(step: Launch, op: dict, maps: list, spans: _Spans) -> tuple[Param, ...]:
    """A launch's parameters as recipes, by the roles abi.params gives them."""
    spec = abi.params(args_for(step.kernel))
    if [n for _, _, n in spec] != [len(b) for b in op["params"]]:
        raise PlanExportError(f"{step.kernel.name}: its spec's parameter sizes are not the "
                              f"cubin's: rebuild the cubins")
    out = []
    for (arg, role, size), blob in zip(spec, op["params"], strict=True):
        what = f"{step.kernel.name} parameter {arg} ({role})"
        if role == "tma_descriptor":
            if blob[:len(_TMA_MARK)] != _TMA_MARK:
                raise PlanExportError(f"{what}: not a descriptor the launcher encoded")
            m = maps[struct.unpack_from("<Q", blob, len(_TMA_MARK))[0]]
            out.append(Param(arg, role, size, tma=Tma(
                spans(m["ptr"], what), m["dtype"], m["dims"], m["row_stride_bytes"], m["box"],
                m["swizzle"])))
        elif role == "tensor":
            ptr = struct.unpack_from("<Q", blob)[0]
            out.append(Param(arg, role, size, bytes(8) + blob[8:], spans(ptr, what)))
        else:
            out.append(Param(arg, role, size, blob))
    return tuple(out)


# --------------------------------------------------------------------------- the entry point
def _call(B, T, H, K, V, initial_state: bool, final_state: bool, scale, lower_bound) -> Call:
    """fwd's call of a fixed-length forward, as CPU tensors nothing reads (contiguous)."""
    bf16, f32 = torch.bfloat16, torch.float32

    def empty(*shape, dtype=bf16):
        return torch.empty(*shape, dtype=dtype)

    return Call(empty(B, T, H, K), empty(B, T, H, K), empty(B, T, H, V), empty(B, T, H, K),
                empty(B, T, H), empty(B, T, H, V), empty(H, dtype=f32), empty(H, K, dtype=f32),
                empty(B, H, V, K, dtype=f32) if initial_state else None,
                empty(B, H, V, K, dtype=f32) if final_state else None, None, scale,
                lower_bound)


def _int(name: str, value, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{name}: expected an int >= {least}, got {value!r}")
    return value


def record_plan(*, B: int, T: int, H: int, K: int, V: int | None = None,
                gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
                precision: str = "fast", wy: str = "off", initial_state: bool = True,
                final_state: bool = True, scale: float | None = None,
                lower_bound: float = -5.0) -> ExportedPlan:
    """The plan of one fixed-length forward, recorded (export_plan's, without writing it)."""
    B, T, H, K = (_int(n, x, 1) for n, x in (("B", B), ("T", T), ("H", H), ("K", K)))
    V = K if V is None else _int("V", V, 1)
    for name, flag in (("initial_state", initial_state), ("final_state", final_state)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool (whether the forward has one), got "
                            f"{type(flag).__name__}")
    scale = K ** -0.5 if scale is None else scale
    opts = checks.options(gate, qk_l2norm, beta_sigmoid, segments=1, precision=precision,
                          alongside=False, wy=wy)
    call = _call(B, T, H, K, V, initial_state, final_state, scale, lower_bound)
    problem = dict(B=B, T=T, H=H, K=K, V=V, N=B, gate=gate, qk_l2norm=qk_l2norm,
                   beta_sigmoid=beta_sigmoid, precision=precision, wy=wy, scale=scale,
                   lower_bound=lower_bound)
    return _record(call, opts, problem)


def export_plan(out_dir, *, B: int, T: int, H: int, K: int, V: int | None = None,
                gate: str = "bounded", qk_l2norm: bool = True, beta_sigmoid: bool = True,
                precision: str = "fast", wy: str = "off", initial_state: bool = True,
                final_state: bool = True, scale: float | None = None,
                lower_bound: float = -5.0) -> ExportedPlan:
    """Write `out_dir`/kda_cute_plan.h for one forward of `kda_cute.fwd`'s call: q, k, g
    [B, T, H, K] and v, out [B, T, H, V] bf16, beta [B, T, H] bf16, A_log [H] and dt_bias
    [H, K] fp32, initial_state / final_state [B, H, V, K] fp32 (each left out where False), all
    contiguous; gate, qk_l2norm, beta_sigmoid, precision as fwd's; wy: K2's WY form ("off":
    the arithmetic of fwd's alongside schedule; "auto", "force": see Options); scale (None:
    K ** -0.5) and lower_bound as fwd's, baked into the plan. K2 runs serially after K1 on one
    stream, without segments. Returns the recorded plan; raises ValueError / TypeError for a
    bad argument (fwd's checks) and PlanExportError for what the header cannot express."""
    plan = record_plan(B=B, T=T, H=H, K=K, V=V, gate=gate, qk_l2norm=qk_l2norm,
                       beta_sigmoid=beta_sigmoid, precision=precision, wy=wy,
                       initial_state=initial_state, final_state=final_state, scale=scale,
                       lower_bound=lower_bound)
    dest = Path(out_dir)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / HEADER).write_text(plan.header())
    return plan


# -------------------------------------------------------------------------------- the header
_PRELUDE = r"""#ifndef KDA_CUTE_PLAN_H
#define KDA_CUTE_PLAN_H

#include <stddef.h>

#include "kda_cute_kernels.h"

/* a buffer the runtime provides: INPUT filled by the caller, OUTPUT written by the forward,
   WORKSPACE any contents (its base aligned to KDA_PLAN_WORKSPACE_ALIGN), ERRORS zeros before
   the forward (a word set after it: kda_plan_error_words says which value was bad), CONSTANT
   `contents` uploaded, SCRATCH any contents; every base 16-byte aligned (TMA, and K2's state
   rows in column pairs: cuMemAlloc's bases are) */
typedef enum { KDA_BUFFER_INPUT, KDA_BUFFER_OUTPUT, KDA_BUFFER_WORKSPACE, KDA_BUFFER_ERRORS,
               KDA_BUFFER_CONSTANT, KDA_BUFFER_SCRATCH } kda_buffer_kind;

/* shape and stride in elements, outermost first; bytes: what it spans */
typedef struct {
  const char *name; kda_buffer_kind kind; const char *dtype;
  unsigned rank; unsigned long long shape[5], stride[5], bytes;
  const unsigned char *contents;
} kda_plan_buffer;

/* a kernel parameter: BYTES copied; ADDRESS the bytes with their first 8 replaced by the
   address of `buffer` + `offset`; TMA a CUtensorMap from cuTensorMapEncodeTiled(dtype, rank,
   address of buffer + offset, dims, {row_stride_bytes}, box, element strides {1, 1},
   INTERLEAVE_NONE, swizzle, L2_PROMOTION_L2_128B, FLOAT_OOB_FILL_NONE); dims and box
   innermost first, in elements; swizzle in bytes (0: none) */
typedef enum { KDA_PARAM_BYTES, KDA_PARAM_ADDRESS, KDA_PARAM_TMA } kda_param_recipe;
typedef enum { KDA_TMA_BFLOAT16, KDA_TMA_FLOAT16, KDA_TMA_FLOAT32 } kda_tma_dtype;

typedef struct {
  kda_param_recipe recipe; unsigned size; const unsigned char *bytes;
  unsigned buffer; unsigned long long offset;
  kda_tma_dtype dtype; unsigned rank; unsigned long long dims[2], row_stride_bytes;
  unsigned box[2], swizzle;
} kda_plan_param;

/* MEMSET_D32: `count` 32-bit words at buffer + offset set to `value` (cuMemsetD32Async);
   LAUNCH: `kernel` with grid, block and `smem` bytes of dynamic shared memory (the function
   allowed at least that much first), as the programmatic dependent of the stream's previous
   kernel where `programmatic`; params in the kernel table's order */
typedef enum { KDA_OP_MEMSET_D32, KDA_OP_LAUNCH } kda_plan_op_kind;

typedef struct {
  kda_plan_op_kind kind; const char *name;
  unsigned buffer; unsigned long long offset; unsigned value; unsigned long long count;
  const kda_kernel *kernel; unsigned grid[3], block[3], smem; int programmatic;
  unsigned num_params; const kda_plan_param *params;
} kda_plan_op;
"""


def _bytes_array(name: str, data: bytes) -> list[str]:
    body = [", ".join(f"0x{b:02x}" for b in data[i:i + 16]) for i in range(0, len(data), 16)]
    return [f"static const unsigned char {name}[{len(data)}] = {{"] + [
        f"  {line}," for line in body] + ["};"]


def _c_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dims(xs, n: int) -> str:
    xs = list(xs) + [0] * (n - len(xs))
    return "{" + ", ".join(f"{x}ULL" for x in xs) + "}"


def header(plan: ExportedPlan) -> str:
    """The C text of `plan`: kda_cute_plan.h."""
    pr = plan.problem
    kinds = {k: "KDA_BUFFER_" + k.upper() for k in BUFFER_KINDS}
    out = ["/* kda-cute forward plan: written by kda_cute.plan_export for one problem; replay "
           "its ops",
           "   in order on one stream (examples/cpp/kda_forward.cpp). What the launcher runs:",
           ""] + [f"   {line}" for line in plan.describe.replace("*/", "* /").splitlines()] + [
           f"   gate {pr['gate']}, qk_l2norm {pr['qk_l2norm']}, beta_sigmoid "
           f"{pr['beta_sigmoid']}, wy {pr['wy']},",
           f"   scale {pr['scale']!r} and lower_bound {pr['lower_bound']!r} baked into the "
           f"parameters */", _PRELUDE]
    out += [f"#define KDA_PLAN_{n} {pr[n]}" for n in ("B", "T", "H", "K", "V", "N")]
    out += [f"#define KDA_PLAN_SCALE {float(pr['scale'])!r}",
            f"#define KDA_PLAN_LOWER_BOUND {float(pr['lower_bound'])!r}",
            f"#define KDA_PLAN_WORKSPACE_BYTES {plan.workspace_bytes}ULL",
            f"#define KDA_PLAN_WORKSPACE_ALIGN {ALIGN}",
            f"#define KDA_PLAN_NUM_BUFFERS {len(plan.buffers)}",
            f"#define KDA_PLAN_NUM_OPS {len(plan.ops)}",
            f"#define KDA_PLAN_NUM_ERROR_WORDS {len(ERRORS)}", ""]
    out += [f"#define KDA_PLAN_BUFFER_{b.name} {i}" for i, b in enumerate(plan.buffers)] + [""]

    out.append("/* what a set error word means (kda_cute.specs.step.ERRORS) */")
    out.append("static const char *const kda_plan_error_words[] = {")
    out += [f"  {_c_str(e)}," for e in ERRORS] + ["};", ""]

    for b in plan.buffers:
        if b.contents is not None:
            out += _bytes_array(f"kda_plan_contents_{b.name}", b.contents)
    out.append("static const kda_plan_buffer kda_plan_buffers[] = {")
    for b in plan.buffers:
        contents = f"kda_plan_contents_{b.name}" if b.contents is not None else "NULL"
        out.append(f"  /* {b.name}: {b.dtype} {list(b.shape)} */")
        out.append(f"  {{{_c_str(b.name)}, {kinds[b.kind]}, {_c_str(b.dtype)}, {len(b.shape)}, "
                   f"{_dims(b.shape, MAX_RANK)}, {_dims(b.stride, MAX_RANK)}, {b.nbytes}ULL, "
                   f"{contents}}},")
    out += ["};", ""]

    def buf(i: int) -> str:
        return f"KDA_PLAN_BUFFER_{plan.buffers[i].name}"

    rows = []
    for i, op in enumerate(plan.ops):
        if isinstance(op, MemsetOp):
            rows.append(f"  {{KDA_OP_MEMSET_D32, {_c_str(op.name)}, {buf(op.at.buffer)}, "
                        f"{op.at.offset}ULL, {op.value}u, {op.count}ULL, NULL, {{0, 0, 0}}, "
                        f"{{0, 0, 0}}, 0, 0, 0, NULL}},")
            continue
        params = []
        for j, p in enumerate(op.params):
            data = "NULL"
            if p.tma is None:
                data = f"kda_plan_op{i}_p{j}"
                out += _bytes_array(data, p.literal)
            if p.tma is not None:
                t = p.tma
                params.append(f"  {{KDA_PARAM_TMA, {p.size}, NULL, {buf(t.at.buffer)}, "
                              f"{t.at.offset}ULL, {TMA_DTYPES[t.dtype]}, 2, {_dims(t.dims, 2)}, "
                              f"{t.row_stride_bytes}ULL, {{{t.box[0]}, {t.box[1]}}}, "
                              f"{t.swizzle}}}, /* {p.arg} */")
            elif p.address is not None:
                params.append(f"  {{KDA_PARAM_ADDRESS, {p.size}, {data}, {buf(p.address.buffer)}, "
                              f"{p.address.offset}ULL, KDA_TMA_BFLOAT16, 0, {{0, 0}}, 0, "
                              f"{{0, 0}}, 0}}, /* {p.arg} */")
            else:
                params.append(f"  {{KDA_PARAM_BYTES, {p.size}, {data}, 0, 0, KDA_TMA_BFLOAT16, "
                              f"0, {{0, 0}}, 0, {{0, 0}}, 0}}, /* {p.arg} ({p.role}) */")
        out.append(f"static const kda_plan_param kda_plan_op{i}_params[] = {{")
        out += params + ["};", ""]
        g, bl = op.grid, op.block
        rows.append(f"  {{KDA_OP_LAUNCH, {_c_str(op.name)}, 0, 0, 0, 0, &{c_ident(op.kernel)}, "
                    f"{{{g[0]}, {g[1]}, {g[2]}}}, {{{bl[0]}, {bl[1]}, {bl[2]}}}, {op.smem}, "
                    f"{int(op.programmatic)}, {len(op.params)}, kda_plan_op{i}_params}},")
    out.append("static const kda_plan_op kda_plan_ops[] = {")
    out += rows + ["};", "", "#endif", ""]
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="kda-cute plan",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the folder `kda-cute export` wrote")
    for n in ("B", "T", "H", "K"):
        ap.add_argument(f"--{n}", type=int, required=True)
    ap.add_argument("--V", type=int, default=None)
    ap.add_argument("--gate", default="bounded", choices=("bounded", "unbounded", "none"))
    ap.add_argument("--precision", default="fast", choices=("fast", "precise"))
    ap.add_argument("--wy", default="off", choices=("off", "auto", "force"))
    ap.add_argument("--no-qk-l2norm", action="store_true")
    ap.add_argument("--no-beta-sigmoid", action="store_true")
    ap.add_argument("--no-initial-state", action="store_true")
    ap.add_argument("--no-final-state", action="store_true")
    ap.add_argument("--scale", type=float, default=None)
    ap.add_argument("--lower-bound", type=float, default=-5.0)
    a = ap.parse_args(argv)
    try:
        plan = export_plan(a.out, B=a.B, T=a.T, H=a.H, K=a.K, V=a.V, gate=a.gate,
                           qk_l2norm=not a.no_qk_l2norm, beta_sigmoid=not a.no_beta_sigmoid,
                           precision=a.precision, wy=a.wy,
                           initial_state=not a.no_initial_state,
                           final_state=not a.no_final_state, scale=a.scale,
                           lower_bound=a.lower_bound)
    except (ValueError, TypeError, PlanExportError) as e:
        print(f"plan_export: {e}", file=sys.stderr)
        return 2
    print(f"{HEADER} written to {a.out}: {len(plan.ops)} ops, {len(plan.buffers)} buffers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
