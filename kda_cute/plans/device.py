"""What a plan needs to know of the device and of each kernel, as plain numbers: the device's SM
count and shared memory (from its properties), each kernel's threads, registers and shared
memory (from its manifest), and the residency they allow. No driver call."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..cubin import CubinsMissing, load_manifest, manifest


@dataclass(frozen=True)
class DeviceInfo:
    """A device as a plan sees it: its cubin folder (`arch`), SM count and shared memory per SM
    and per CTA (opt-in), in bytes."""

    arch: str
    sms: int
    smem_per_sm: int
    smem_per_block: int


# An H200 (and H100 SXM): for planning without the device (CPU tests, export, describe)
H200 = DeviceInfo("sm_90a", 132, 233472, 232448)


@functools.lru_cache(maxsize=16)
def device_info(device) -> DeviceInfo:
    """The DeviceInfo of a CUDA device (index or torch.device), read once."""
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    prop = torch.cuda.get_device_properties(device)
    return DeviceInfo(f"sm_{major}{minor}" + ("a" if major >= 9 else ""),
                      prop.multi_processor_count,
                      getattr(prop, "shared_memory_per_multiprocessor", 233472),
                      getattr(prop, "shared_memory_per_block_optin", 232448))


def ready(device=None) -> tuple[bool, str]:
    """Whether kda-cute's kernels run on `device` (an index or torch.device; None: the current
    one): a Hopper GPU (sm_90) and every shipped cubin built. (ok, why not)."""
    import torch

    from ..ladder import all_kernels
    if not torch.cuda.is_available():
        return False, "no CUDA device"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        return False, f"kernels target sm_90a, device is sm_{major}{minor}"
    try:
        for cfg in all_kernels():
            load_manifest(cfg.name, "sm_90a")
    except CubinsMissing as e:
        return False, str(e)
    return True, ""


@dataclass(frozen=True)
class Resources:
    """A kernel's launch resources, from its manifest."""

    threads: int
    registers: int
    smem: int  # dynamic shared memory per CTA


@functools.lru_cache(maxsize=256)
def resources(cfg, arch: str) -> Resources:
    m = manifest(cfg.name, arch)
    return Resources(int(m["block"][0]), int(m["registers"]), int(m["dynamic_smem_bytes"]))


# an SM hands out shared memory to a CTA in whole units of this many bytes (its launch request
# plus the 1 KB the system reserves per CTA)
SMEM_UNIT = 128
SMEM_RESERVED = 1024


def smem_unit(nbytes: int) -> int:
    """A CTA's shared memory as the SM allocates it: rounded up to whole SMEM_UNITs."""
    return -(-nbytes // SMEM_UNIT) * SMEM_UNIT


def resident_per_sm(dev: DeviceInfo, res: Resources) -> int:
    """A kernel's CTAs one SM holds at once: the fewest that its shared memory, its registers
    (allocated per warp in units of 256) and its threads allow."""
    regs = -(-res.registers * 32 // 256) * 256 * -(-res.threads // 32)
    return max(1, min(dev.smem_per_sm // smem_unit(res.smem + SMEM_RESERVED), 65536 // regs,
                      2048 // res.threads))


def resident(dev: DeviceInfo, res: Resources) -> int:
    """A kernel's CTAs resident at once on the whole device."""
    return dev.sms * resident_per_sm(dev, res)
