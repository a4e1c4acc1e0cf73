"""The device tensors the launcher keeps for plans (steps.Buffer): constants made once per
device (zeros, identities, ramps, segment offsets; nothing writes them) and scratch tensors made
once per device and stream (written and read within one forward: forwards on one stream run in
order, so each finishes with them before the next starts). Neither is kept while a stream is
being captured (a captured kernel runs only at replay, so the tensor would hold garbage until
then).

A captured graph uses the addresses it was captured with for as long as it lives, and nothing
ties a cached tensor to it: the caches drop tensors (a full cache is emptied; clear()), and a
dropped one's memory goes to the next allocation. So a capture takes no scratch from the cache:
it makes its own, from the capture's memory pool, which torch keeps for the graph (its kernels
write it before they read it). A constant made before the capture is handed to it and pinned
(kept for good, however the caches are emptied: a constant's values cannot be made again by the
graph); one that is not yet made is made by kernels of the capture, for it alone."""

from __future__ import annotations

import torch

from ..checks import capturing
from ..plans.steps import Buffer

_constants: dict[tuple, torch.Tensor] = {}
_scratches: dict[tuple, torch.Tensor] = {}
_ramps: dict[tuple, torch.Tensor] = {}  # its own: varlen batches of many sizes must not push
# out the segments' large constants
_MAX = 16
# the constants captured graphs read: never dropped (a few per shape an engine captures)
_pinned: dict[tuple, torch.Tensor] = {}


def _make(b: Buffer, dev) -> torch.Tensor:
    if b.kind == "zeros":
        return torch.zeros(b.shape, dtype=b.dtype, device=dev)
    if b.kind == "eye":
        return torch.eye(b.shape[-1], dtype=b.dtype, device=dev).expand(b.shape).contiguous()
    if b.kind == "ramp":
        return torch.arange(b.shape[0], dtype=b.dtype, device=dev)
    if b.kind == "segments":
        return _segment_offsets(*b.params, dev)
    return torch.empty(b.shape, dtype=b.dtype, device=dev)


def _segment_offsets(B: int, T: int, C: int, P: int, which: str, dev) -> torch.Tensor:
    """segments.plan's offsets (cu_seqlens or cu_chunks), built on the device (no host copy,
    so it can be graph-captured)."""
    nc = -(-T // C)
    cps = max(1, -(-nc // P))
    idx = torch.arange(B * P, device=dev, dtype=torch.int32)
    b, j = idx // P, idx % P
    c1 = torch.clamp((j + 1) * cps, max=nc)
    out = torch.zeros(B * P + 1, device=dev, dtype=torch.int32)
    out[1:] = b * T + torch.clamp(c1 * C, max=T) if which == "cu_seqlens" else b * nc + c1
    return out


def get(b: Buffer, dev, stream: int) -> torch.Tensor:
    """The tensor of `b` on `dev` (scratch: for `stream`)."""
    capture = capturing(dev)
    if b.kind == "scratch":
        if capture:
            return _make(b, dev)
        cache, key = _scratches, (b, dev, stream)
    else:
        cache, key = (_ramps if b.kind == "ramp" else _constants), (b, dev)
    hit = cache.get(key)  # (a key both hold is the same tensor: a pinned one came from here)
    if hit is None:
        hit = _pinned.get(key)
    if capture:
        if hit is not None:
            _pinned[key] = hit
        return hit if hit is not None else _make(b, dev)
    if hit is None:
        hit = _make(b, dev)
        if len(cache) >= _MAX:
            cache.clear()
        cache[key] = hit
    return hit


def clear() -> None:
    """Drop the cached tensors (not the pinned constants: graphs captured with them may still
    replay)."""
    for cache in (_constants, _scratches, _ramps):
        cache.clear()
