"""The calling thread's current CUDA device, its current stream's handle, and whether that
stream is capturing a graph, read from torch's C API. torch.cuda's wrappers (a Stream object
built per current_stream call, a device argument parsed per device context) cost microseconds
an eager call makes several times; these are the reads a launch needs and no more. Tests on a
CPU substitute the three functions (tests/launch_record.fake_device)."""

from __future__ import annotations

import torch


def device() -> int:
    """The current device's index (CUDA initialised first, as torch.cuda.current_device)."""
    torch.cuda.init()
    return torch._C._cuda_getDevice()


def stream(device: int) -> int:
    """The handle of `device`'s current stream (torch.cuda.current_stream(device).cuda_stream)."""
    return torch._C._cuda_getCurrentRawStream(device)


def capturing() -> bool:
    """Whether the current device's current stream is capturing a CUDA graph."""
    return torch._C._cuda_isCurrentStreamCapturing()
