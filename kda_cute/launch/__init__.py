"""Running plans: `run(plan, call, workspace, stream)` resolves each step's sources to the call's
pointers (and the workspace's, the launcher's buffers'), packs the parameters (cached by their
values) and launches; `bind(plan, call, workspace, stream)` does all of that once and returns a
`Bound` whose call only launches: a serving loop's fixed buffers, refilled each step."""

from __future__ import annotations

import contextlib

import torch

from .. import checks, errors, memo
from ..plans.steps import (
    At,
    CallScalar,
    Copy,
    Errors,
    Fork,
    Join,
    Launch,
    Memset,
    Merge,
    Plane,
    Role,
    Scalar,
)
from ..plans.workspace import ALIGN
from . import buffers, current, driver
from .streams import alongside_order, side


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
        if isinstance(src, Errors):
            return errors.address(self.dev)
        raise TypeError(f"not a source: {src!r}")


def _ops(plan, call, workspace, dev, device: int, stream: int) -> tuple[list, _Sources]:
    """The plan's steps as (function, arguments, whether it takes the call first), every
    source resolved and every kernel loaded on `device` before any step runs (a first load
    waits for the device to go idle). The torch-side steps take the call's tensors when they
    run, so resolved steps hold no caller tensor."""
    src = _Sources(call, workspace, dev, stream)
    ops = []
    on = stream  # the stream the next launch goes to: the call's, or after a Fork its side's
    first = False  # (the side stream of the last Fork: its priority)
    for s in plan.steps:
        if isinstance(s, Launch):
            k = driver.get_kernel(s.kernel, plan.device.arch)
            arr = k.packed(s.args, tuple(src.value(x) for x in s.sources), s.syms)
            ops.append((k.launch, (k.function(device, s.smem), s.grid, arr, on, s.smem,
                                   s.programmatic), False))
        elif isinstance(s, Memset):
            ops.append((driver.memset_d32, (src.value(s.target), s.value, s.count, on),
                        False))
        elif isinstance(s, Fork):
            first = s.first
            on, fork, _ = side(device, stream, first)
            ops.append((driver.record_event, (fork, stream), False))
            ops.append((driver.wait_event, (on, fork), False))
        elif isinstance(s, Merge):
            on = stream
        elif isinstance(s, Join):
            aside, _, join = side(device, stream, first)
            ops.append((driver.record_event, (join, aside), False))
            ops.append((driver.wait_event, (stream, join), False))
        elif isinstance(s, Copy):
            if on != stream:
                raise ValueError(f"plan: a torch-side step ({s.name}) on the side stream")
            ops.append((_copy, (_late(src, s.dst), _late(src, s.src)), True))
        else:
            raise TypeError(f"not a step: {s!r}")
    return ops, src


def _late(src: _Sources, x):
    """A Copy end: a Role's name (the call's tensor, taken when the step runs) or a buffer."""
    return x.name if isinstance(x, Role) else src.tensor(x)


def _copy(call, dst, src) -> None:
    dst = getattr(call, dst) if isinstance(dst, str) else dst
    dst.copy_(getattr(call, src) if isinstance(src, str) else src)


def _execute(ops, call) -> None:
    for fn, args, late in ops:
        if late:
            fn(call, *args)
        else:
            fn(*args)


def device_of(call):
    """The device of a call: its q's (a prefill, a serving step with tokens) or its pool's (a
    commit)."""
    return (call.q if call.q is not None else call.pool).device


def _handle(stream) -> int:
    """A given stream's handle (a torch.cuda.Stream, or anything with its cuda_stream)."""
    try:
        h = stream.cuda_stream
    except AttributeError:
        raise TypeError(f"stream: expected a torch.cuda.Stream or None, got "
                        f"{type(stream).__name__}") from None
    if isinstance(h, bool) or not isinstance(h, int):
        raise TypeError(f"stream: expected a torch.cuda.Stream or None, got a cuda_stream of "
                        f"{type(h).__name__}")
    return h


_no_workspace: dict = {}


def _workspace(plan, workspace, dev):
    if workspace is None and not plan.workspace_bytes:  # one empty tensor per device
        ws = _no_workspace.get(dev)
        if ws is None:
            ws = _no_workspace[dev] = torch.empty(0, dtype=torch.uint8, device=dev)
        return ws
    if workspace is None:
        return torch.empty(plan.workspace_bytes, dtype=torch.uint8, device=dev)
    checks.workspace(workspace, plan.workspace_bytes, dev)
    return workspace


# resolved steps of recent runs, by everything resolving reads: the plan (by identity, held in
# the entry), the device, the stream, the workspace's and every call tensor's address, and the
# call's scalars; a repeated call (a serving loop's buffers, a benchmark) launches straight away
_resolved: dict[tuple, tuple] = {}
_RESOLVED_MAX = 256  # (a model's layers: one entry each, as _AGAIN_MAX below)


def run(plan, call, workspace: torch.Tensor | None = None, stream=None, keep=None) -> None:
    """Launch `plan` for `call` (a problem.Call whose metadata the plan was made from) on
    `stream` (a torch.cuda.Stream; None: the current one of the call's device). `workspace`:
    a caller-owned uint8 tensor of >= plan.workspace_bytes bytes, or None to allocate one.
    `keep`: (cache, addresses), a caller's dict and the addresses of the call's tensors, where
    the resolved steps of a plan that `again` can repeat are kept for `again`."""
    dev = device_of(call)
    here = current.device()
    device = dev.index if dev.index is not None else here
    if device != here:  # (torch's device context only where it changes something)
        with torch.cuda.device(device):
            return run(plan, call, workspace, stream, keep)
    ws = _workspace(plan, workspace, dev)
    h = current.stream(device) if stream is None else _handle(stream)
    capturing = current.capturing()
    # not kept: buffers made for one capture. A workspace allocated here is kept by its
    # address, as a caller's is: the allocator mostly hands the same block to the next call
    key = None if capturing else (
        id(plan), driver.generation, device, h, ws.data_ptr(),
        *(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in call))
    hit = _resolved.get(key) if key is not None else None
    if hit is not None and hit[2] is plan:
        ops, held = hit[0], hit[1]
    else:
        ops, src = _ops(plan, call, ws, dev, device, h)
        held = list(src.held.values())
        if key is not None:
            memo.bounded_put(_resolved, _RESOLVED_MAX, key, (ops, held, plan))
    if keep is not None and key is not None and repeatable(plan):
        cache, addresses = keep
        memo.bounded_put(cache, _AGAIN_MAX, (addresses, driver.generation, device, h),
                         (ops, held))
    ordered = plan.alongside and not capturing
    if stream is None and not ordered:  # the common case, without the contexts' cost
        _execute(ops, call)
    else:
        on = contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)
        with on, alongside_order(device, h, ordered):
            _execute(ops, call)


# a caller's cache of resolved steps for `again` holds this many entries at most: a model's
# layers call with one metadata and their own pools and weights, an entry each
_AGAIN_MAX = 256


def repeatable(plan) -> bool:
    """Whether `again` may repeat the plan's resolved steps: no workspace, no torch-side step
    (which takes the call's tensors) and no stream order to keep (an alongside plan)."""
    return (not plan.workspace_bytes and not plan.alongside
            and not any(isinstance(s, Copy) for s in plan.steps))


def again(cache: dict, addresses: tuple, dev: torch.device, stream=None) -> bool:
    """Launch the steps that run(..., keep=(cache, addresses)) resolved for a call whose
    tensors had these addresses (and, by the caller's cache, the same metadata and scalars),
    on the same device and stream: True. False, launching nothing, when there are none (a new
    address, stream or driver), when the call's device `dev` is not the current device, or
    while the current stream captures a graph (a capture takes buffers of its own: run). The
    eager serving calls' path: what run's checks and lookups would find again, without them."""
    here = current.device()
    device = dev.index if dev.index is not None else here
    if device != here or current.capturing():
        return False
    h = current.stream(device) if stream is None else _handle(stream)
    hit = cache.get((addresses, driver.generation, device, h))
    if hit is None:
        return False
    _execute(hit[0], None)
    return True


class Bound:
    """A plan bound to one call's tensors, workspace and stream: each call launches the plan's
    steps again with everything resolved, packed and loaded at bind time, without checking or
    choosing anything. Refill the bound tensors between calls; a varlen plan checks the bound
    cu_seqlens' values and recomputes its chunk offsets from them on the device each call (a
    bad value raises by the next call: kda_cute.errors), and with check_seqlens=True checks
    them on the host first too (a host sync)."""

    def __init__(self, plan, call, workspace=None, stream=None, check_seqlens: bool = False):
        dev = device_of(call)
        with torch.cuda.device(dev):
            device = dev.index if dev.index is not None else torch.cuda.current_device()
            s = torch.cuda.current_stream(dev) if stream is None else stream
            h = _handle(s)
            self.workspace = _workspace(plan, workspace, dev)
            self._ops, src = _ops(plan, call, self.workspace, dev, device, h)
        self.plan, self.call, self.stream = plan, call, s
        self._held = list(src.held.values())  # the buffers its launches read
        self._torch = any(isinstance(x, Copy) for x in plan.steps)
        self._device = device
        self._check = checks.flag("check_seqlens", check_seqlens) and getattr(
            plan.problem, "varlen", False)

    def _capturing(self) -> bool:
        with torch.cuda.device(self._device):
            return torch.cuda.is_current_stream_capturing()

    def __call__(self) -> None:
        # what an earlier call's kernels reported (bad values; a forward's non-finite state)
        errors.raise_pending(self._device)
        capturing = (self._check or self.plan.alongside) and self._capturing()
        if self._check and not capturing:
            checks.seqlens(self.call.cu_seqlens, self.plan.problem.T)
        ordered = self.plan.alongside and not capturing
        if not ordered and not self._torch:  # the serving steps: launches alone
            _execute(self._ops, self.call)
            return
        on = torch.cuda.stream(self.stream) if self._torch else contextlib.nullcontext()
        with on, alongside_order(self._device, self.stream.cuda_stream, ordered):
            _execute(self._ops, self.call)


def bind(plan, call, workspace=None, stream=None, check_seqlens: bool = False) -> Bound:
    """`plan` bound to `call`, `workspace` (None: one allocated and kept) and `stream` (None:
    the current one): see Bound."""
    return Bound(plan, call, workspace, stream, check_seqlens)


def clear() -> None:
    """Drop the launcher's buffers and the resolved steps of recent runs (bound plans keep
    theirs)."""
    buffers.clear()
    _resolved.clear()


__all__ = ["Bound", "again", "bind", "buffers", "current", "driver", "repeatable",
           "run"]
