"""One memo for every call: what a call's checks concluded (a forward's Problem, a serving step's
plan, the fla backend's verdict), kept by the call's kind and its arguments' metadata, so that a
serving loop's repeated call (its buffers refilled each step) skips straight to its launch.
Addresses are never part of a key: the calls check them every time."""

from __future__ import annotations

import torch

MOST = 1024  # entries held; the oldest dropped first, so a batch size changing every step stays
_memo: dict[tuple, object] = {}


def meta(t):
    """What the metadata checks read of an argument: a tensor's dtype, shape, strides and
    device; anything else with its type (True is not 1: a bool scale is refused, 1 is not; an
    unhashable value makes an unhashable key, which is never kept)."""
    if isinstance(t, torch.Tensor):
        try:
            return t.dtype, t.shape, t.stride(), t.device
        except RuntimeError:  # no strides (a sparse tensor, in some torch versions): checked
            return t.dtype, t.shape, t.layout, t.device
    return None if t is None else (type(t), t)


def key(kind: str, tensors: tuple, scalars: tuple = ()) -> tuple:
    """The memo's key of a call of `kind`: meta of each tensor argument (or None), then the
    scalar arguments and their types (a serving loop's hot path: one pass each)."""
    return (kind, *map(meta, tensors), *scalars, *map(type, scalars))


def recall(k):
    """The entry for key `k`, or None (also for a key holding an unhashable value: a list
    given for a scalar, which the checks refuse)."""
    try:
        return _memo.get(k)
    except TypeError:
        return None


def remember(k, value):
    """Keep `value` for key `k` (not for an unhashable key) and return it."""
    try:
        hash(k)
    except TypeError:
        return value
    bounded_put(_memo, MOST, k, value)
    return value


def bounded_put(cache: dict, most: int, k, value) -> None:
    """cache[k] = value, the oldest entry dropped first when `most` are held (a dict keeps
    insertion order)."""
    if len(cache) >= most:
        try:
            del cache[next(iter(cache))]
        except (StopIteration, KeyError, RuntimeError):  # (another thread's eviction)
            pass
    cache[k] = value


def clear() -> None:
    _memo.clear()
