"""One forward's launches as a C header, for a runtime that has only the CUDA driver API.

    kda-cute plan --out DIR --B 1 --T 1000 --H 4 --K 128    (or python -m kda_cute.plan_export)

`export_plan(out_dir, B=, T=, H=, K=, ...)` writes `kda_cute_plan.h` beside what `kda-cute
export` writes (the cubins and `kda_cute_kernels.h`, which it includes): the buffers the runtime
provides (the call's tensors by role, the workspace, the device error words, the launcher's own
small tensors), then one forward's 32-bit memsets and kernel launches in order, each parameter a
recipe (literal bytes, a buffer's address, or a TMA descriptor to encode; kda_cute.plan_header
says what each record holds). examples/cpp/kda_forward.cpp runs such a header.

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
import struct
import sys
from pathlib import Path

import torch

from . import abi, checks, launch, plans
from .abi import c_ident  # the identifiers kda_cute_kernels.h gives its kernels
from .cubin import load_manifest
from .launch import driver as kdriver
from .plan_header import (
    MAX_RANK,
    Address,
    ExportedPlan,
    LaunchOp,
    MemsetOp,
    Param,
    PlanBuffer,
    PlanExportError,
    Tma,
)
from .plan_record import _TMA_MARK, ARCH, _on_the_cpu, _Recorder
from .plans.steps import Copy, Launch, Memset
from .plans.workspace import ALIGN
from .problem import Call
from .specs import args_for
from .specs.step import ERRORS

HEADER = "kda_cute_plan.h"
# the call's tensors a plan may read or write, in Call order, and whether the forward reads or
# writes them
ROLES = {"q": "input", "k": "input", "v": "input", "g": "input", "beta": "input",
         "out": "output", "A_log": "input", "dt_bias": "input", "initial_state": "input",
         "final_state": "output"}


def _extent(t: torch.Tensor) -> int:
    """The bytes a tensor spans, from its first element to past its last."""
    if not t.numel():
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
            ) * t.element_size()


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
    # the workspace ALIGN-aligned: the launcher's offsets from its aligned base are from its start
    ws = torch.empty(plan.workspace_bytes + ALIGN, dtype=torch.uint8)
    ws = ws[(-ws.data_ptr()) % ALIGN:][:plan.workspace_bytes]
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
        buffers.append(PlanBuffer(name, kind, str(t.dtype).removeprefix("torch."),
                                  tuple(t.shape), tuple(t.stride()), _extent(t), contents))

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
    for flag in ("qk-l2norm", "beta-sigmoid", "initial-state", "final-state"):
        ap.add_argument(f"--no-{flag}", action="store_true")
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
