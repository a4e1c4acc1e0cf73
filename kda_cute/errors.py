"""Bad values found on the device, reported without a host sync.

Index, length and count values live on the device; checking them on the host would stall the
stream. The token-step kernel never follows a bad one (the row becomes a padding row), nor do
K2 and the combine a bad pool slot, nor any kernel a bad prefill cu_seqlens (the offsets kernel
turns the batch into empty sequences); each sets the argument's error word instead: one word
per argument (kda_cute.specs.step.ERRORS) in page-locked host memory that the kernel writes
through the unified address space, so the host reads it without waiting for anything. Every
serving call and every forward reads the words first and raises
for what an earlier call left (`raise_pending`); `check_errors()` does the same on demand
(sync=True: after the device has finished the work queued so far). The words are made once
per device and never freed, so a captured CUDA graph's kernels keep a valid address.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from .specs.offsets import E_PREFILL_CU
from .specs.step import ERROR_ROLES, ERROR_WORDS, ERRORS

E_NONFINITE = 7  # a forward's state became non-finite (kernels.common.E_NONFINITE)
assert ERRORS[E_NONFINITE].startswith("precision")

_words: dict[int, tuple[torch.Tensor, ctypes.Array]] = {}
_lock = threading.Lock()


class DeviceValueError(ValueError):
    """A serving call was given a bad index, length or count value (found by the kernel)."""


def _index(device) -> int:
    if isinstance(device, torch.device):
        return device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.current_device() if device is None else int(device)


def words(device) -> tuple[torch.Tensor, ctypes.Array]:
    """The error words of `device`: (the page-locked tensor, a ctypes view of its words)."""
    d = _index(device)
    hit = _words.get(d)
    if hit is None:
        with _lock:
            hit = _words.get(d)
            if hit is None:
                # (page-locked where there is a device to see it; plain memory on a machine
                # without CUDA, where plans are made and inspected but nothing runs)
                t = torch.zeros(ERROR_WORDS, dtype=torch.int32,
                                pin_memory=torch.cuda.is_available())
                hit = _words[d] = (t, (ctypes.c_int32 * ERROR_WORDS).from_address(t.data_ptr()))
    return hit


def address(device) -> int:
    """The words' address as the kernels see it (page-locked memory is mapped at the same
    address on every device of the unified address space)."""
    return words(device)[0].data_ptr()


_noted: dict[int, dict[int, dict[str, None]]] = {}
_NOTED_MOST = 4  # names kept a word, the latest last


def note(device, call: str, names) -> None:
    """What a call on `device` passed for each word its kernels may set ((word, argument)s),
    noted when the call is planned (not at each call: its plan and names are kept together),
    so that a word set later is reported with the argument the caller passed."""
    by_word = _noted.setdefault(_index(device), {})
    for i, arg in names:
        seen = by_word.setdefault(i, {})
        text = f"{arg} ({call}'s {ERROR_ROLES[i]})"
        seen.pop(text, None)
        seen[text] = None
        if len(seen) > _NOTED_MOST:
            del seen[next(iter(seen))]


def forget() -> None:
    """Drop the noted names (kda_cute.clear_caches: the calls planned next note theirs)."""
    _noted.clear()


def _named(d: int, i: int) -> str:
    """Word i's argument as the calls planned on device d passed it (several where calls of
    different kinds fill it), else the word's general description."""
    seen = _noted.get(d, {}).get(i)
    return " or ".join(seen) if seen and i < len(ERROR_ROLES) else ERRORS[i]


def raise_pending(device) -> None:
    """Raise DeviceValueError for any word set by a kernel that has finished by now (no wait),
    naming the arguments, and clear the words."""
    d = _index(device)
    hit = _words.get(d)
    if hit is None:
        return
    view = hit[1]
    if not any(view):
        return
    bad = [_named(d, i) for i in range(ERROR_WORDS) if view[i]]
    rows = any(view[i] for i in range(ERROR_WORDS) if i not in (E_PREFILL_CU, E_NONFINITE))
    values = any(view[i] for i in range(ERROR_WORDS) if i != E_NONFINITE)
    view[:] = (0,) * ERROR_WORDS
    if not values:
        raise DeviceValueError(f"{bad[0]}, in an earlier forward on cuda:{d}")
    raise DeviceValueError(
        f"{', '.join(bad)}: expected values in range (indices < the pool's slots, offsets "
        f"non-decreasing from 0 and within the tokens, counts within the entries per row), got "
        f"out-of-range values in an earlier call on cuda:{d}"
        + ("; those rows were treated as padding (zero outputs, no state read or written)"
           if rows else ""))
