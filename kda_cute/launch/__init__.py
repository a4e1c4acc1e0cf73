"""Running plans: `run(plan, call, workspace, stream)` resolves each step's sources to the call's
pointers (and the workspace's, the launcher's buffers'), packs the parameters (cached by their
values) and launches; `bind(plan, call, workspace, stream)` does all of that once and returns a
`Bound` whose call only launches: a serving loop's fixed buffers, refilled each step."""

from __future__ import annotations

import contextlib

import torch

from .. import checks
from ..plans.steps import (
    At,
    CallScalar,
    Copy,
    Launch,
    Memset,
    Plane,
    Role,
    Scalar,
    VarlenOffsets,
)
from ..plans.workspace import ALIGN, chunk_slots
from . import buffers, driver
from .streams import alongside_order


class _Sources:
    """Resolves a plan's sources for one call: tensors by role, the workspace's aligned base,
    the launcher's buffers on the call's device and stream (held until the run ends)."""

    __slots__ = ("call", "base", "dev", "stream", "held")

    def __init__(self, call, workspace: torch.Tensor, dev, stream: int):
        self.call, self.dev, self.stream, self.held = call, dev, stream, {}
        base = workspace.data_ptr()
        self.base = base + (-base) % ALIGN

    def tensor(self, src) -> torch.Tensor:
        if isinstance(src, Role):
            return getattr(self.call, src.name)
        t = self.held.get(src)
        if t is None:
            t = self.held[src] = buffers.get(src, self.dev, self.stream)
        return t

    def value(self, src):
        if isinstance(src, Plane):
            return self.base + src.offset
        if isinstance(src, Role):
            return getattr(self.call, src.name).data_ptr()
        if isinstance(src, Scalar):
            return src.value
        if isinstance(src, At):
            return self.tensor(src.buffer).data_ptr() + src.offset
        if isinstance(src, CallScalar):
            return float(getattr(self.call, src.name) or 0.0)
        raise TypeError(f"not a source: {src!r}")


def _ops(plan, call, workspace, dev, device: int, stream: int) -> tuple[list, _Sources]:
    """The plan's steps as (function, arguments), every source resolved and every kernel
    loaded on `device` before any step runs (a first load waits for the device to go idle)."""
    src = _Sources(call, workspace, dev, stream)
    ops = []
    for s in plan.steps:
        if isinstance(s, Launch):
            k = driver.get_kernel(s.kernel, plan.device.arch)
            arr = k.packed(s.args, tuple(src.value(x) for x in s.sources), s.syms)
            ops.append((k.launch, (k.function(device, s.smem), s.grid, arr, stream, s.smem,
                                   s.programmatic)))
        elif isinstance(s, Memset):
            ops.append((driver.memset_d32, (src.value(s.target), s.value, s.count, stream)))
        elif isinstance(s, VarlenOffsets):
            cs = None if s.cs is None else src.tensor(s.cs)
            ops.append((_offsets, (call.cu_seqlens, cs, s.chunk, src.tensor(s.ramp),
                                   src.tensor(s.cc))))
        elif isinstance(s, Copy):
            ops.append((_copy, (src.tensor(s.dst), src.tensor(s.src))))
        else:
            raise TypeError(f"not a step: {s!r}")
    return ops, src


def _offsets(cu_seqlens, cs, chunk, ramp, cc) -> None:
    if cs is not None:
        cs.copy_(cu_seqlens)
    chunk_slots(cu_seqlens if cs is None else cs, chunk, ramp, out=cc)


def _copy(dst, src) -> None:
    dst.copy_(src)


def _where(call, stream):
    dev = call.q.device
    device = dev.index if dev.index is not None else torch.cuda.current_device()
    s = torch.cuda.current_stream(dev) if stream is None else stream
    return dev, device, s


def _workspace(plan, workspace, dev):
    if workspace is None:
        return torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=dev)
    checks.workspace(workspace, plan.workspace_bytes, dev)
    return workspace


def run(plan, call, workspace: torch.Tensor | None = None, stream=None) -> None:
    """Launch `plan` for `call` (a problem.Call whose metadata the plan was made from) on
    `stream` (a torch.cuda.Stream; None: the current one of the call's device). `workspace`:
    a caller-owned uint8 tensor of >= plan.workspace_bytes bytes, or None to allocate one."""
    dev = call.q.device
    with torch.cuda.device(dev):
        dev, device, s = _where(call, stream)
        ws = _workspace(plan, workspace, dev)
        ops, _ = _ops(plan, call, ws, dev, device, s.cuda_stream)
        ordered = plan.alongside and not checks.capturing(dev)
        with _on(stream), alongside_order(device, s.cuda_stream, ordered):
            for fn, args in ops:
                fn(*args)


def _on(stream):
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


class Bound:
    """A plan bound to one call's tensors, workspace and stream: each call launches the plan's
    steps again with everything resolved, packed and loaded at bind time, without checking or
    choosing anything. Refill the bound tensors between calls; a varlen plan recomputes its
    chunk offsets from the bound cu_seqlens' values each call, and checks them first (a host
    sync) unless bound with check_seqlens=False."""

    def __init__(self, plan, call, workspace=None, stream=None, check_seqlens: bool = True):
        dev = call.q.device
        with torch.cuda.device(dev):
            dev, device, s = _where(call, stream)
            self.workspace = _workspace(plan, workspace, dev)
            self._ops, src = _ops(plan, call, self.workspace, dev, device, s.cuda_stream)
        self.plan, self.call, self.stream = plan, call, s
        self._held = list(src.held.values())  # the buffers its launches read
        self._torch = any(isinstance(x, (VarlenOffsets, Copy)) for x in plan.steps)
        self._device, self._dev = device, dev
        self._check = check_seqlens and plan.problem.varlen

    def __call__(self) -> None:
        if self._check and not checks.capturing(self._dev):
            checks.seqlens(self.call.cu_seqlens, self.plan.problem.T)
        ordered = self.plan.alongside and not checks.capturing(self._dev)
        on = torch.cuda.stream(self.stream) if self._torch else contextlib.nullcontext()
        with on, alongside_order(self._device, self.stream.cuda_stream, ordered):
            for fn, args in self._ops:
                fn(*args)


def bind(plan, call, workspace=None, stream=None, check_seqlens: bool = True) -> Bound:
    """`plan` bound to `call`, `workspace` (None: one allocated and kept) and `stream` (None:
    the current one): see Bound."""
    return Bound(plan, call, workspace, stream, check_seqlens)


def clear() -> None:
    """Drop the launcher's buffers (bound plans keep theirs)."""
    buffers.clear()


__all__ = ["Bound", "bind", "buffers", "driver", "run"]
