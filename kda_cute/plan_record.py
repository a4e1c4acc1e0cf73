"""The CUDA driver replaced by a recorder, and the launcher run on CPU tensors: what
kda_cute.plan_export hands a plan's launches through to write them down instead of running
them."""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading

import torch

from . import errors, launch
from .cubin import load_manifest
from .launch import driver as kdriver
from .plan_header import PlanExportError

ARCH = "sm_90a"


# what launch.driver.encode_tiled passes for every descriptor; the runtime passes the same, so a
# change there must be a change here (the recorder refuses anything else)
TMA_FIXED = {"interleave": "CU_TENSOR_MAP_INTERLEAVE_NONE",
             "l2": "CU_TENSOR_MAP_L2_PROMOTION_L2_128B",
             "oob": "CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE", "element_strides": [1, 1]}


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

    def _launch(self, f, grid, block, smem, addr, programmatic, extra):
        name = self.kernels[f]
        if extra:
            raise PlanExportError(f"{name}: launched with `extra` options")
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
        return self._launch(f, (gx, gy, gz), (bx, by, bz), smem, addr, False, extra)

    def cuLaunchKernelEx(self, conf, f, addr, extra):  # noqa: N802
        for a in conf.attrs[:conf.numAttrs]:
            if (a.id != "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"
                    or getattr(a.value, "programmaticStreamSerializationAllowed", 0) != 1):
                raise PlanExportError(f"{self.kernels[f]}: launch attribute {a.id} is not one "
                                      f"kda_cute_plan.h expresses")
        return self._launch(f, (conf.gridDimX, conf.gridDimY, conf.gridDimZ),
                            (conf.blockDimX, conf.blockDimY, conf.blockDimZ),
                            conf.sharedMemBytes, addr, conf.numAttrs > 0, extra)

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


_lock = threading.Lock()


@contextlib.contextmanager
def _on_the_cpu(error_words: torch.Tensor, taken: dict):
    """launch.run on CPU tensors: launch.current answers as device 0 with stream 0 and no
    capture (a CPU call's device is the current one, so no torch.cuda call is made), the device
    error words are `error_words`, and each launcher buffer the run takes is noted in `taken`
    (Buffer -> tensor). Everything is put back on exit; the lock keeps two exports from
    interleaving (a forward on a GPU meanwhile, in another thread, would see the stand-ins:
    export where nothing else runs)."""
    real_get = launch.buffers.get

    def get(b, dev, stream):
        t = taken[b] = real_get(b, dev, stream)
        return t

    patches = [(launch.current, "device", lambda: 0),
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
