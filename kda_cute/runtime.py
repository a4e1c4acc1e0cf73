"""DSL-free launcher: cubins + manifests -> cuLaunchKernel on torch's current stream.

Only torch and cuda.bindings are needed at run time. A manifest (written by kernels/build.py) names
the entry point, block, dynamic shared memory and the parameter table read from the cubin; the
argument list in kda_cute.abi says how to build each parameter.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import threading
from pathlib import Path

from . import abi

CUBIN_ROOT = Path(os.environ.get("KDA_CUTE_CUBIN_DIR", Path(__file__).parent / "_cubins"))
BUILD_HINT = "build them with `make kernels` (or `python -m kernels.build --arch {arch}`)"


class CubinsMissing(RuntimeError):
    pass


def _cu():
    from cuda.bindings import driver
    return driver


def check(res):
    """cuda.bindings returns (err, *values): raise on error, return the values."""
    cu = _cu()
    if not isinstance(res, tuple):
        res = (res,)
    err, vals = res[0], res[1:]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver error {err.name}: {msg.decode() if msg else ''}")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


@functools.lru_cache(maxsize=64)
def arch_of(device) -> str:
    """The cubin folder for a device (index or torch.device): sm_XY, with 'a' from sm_90 on."""
    import torch
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")


def load_manifest(name: str, arch: str) -> tuple[dict, Path]:
    folder = CUBIN_ROOT / arch
    man, cub = folder / f"{name}.json", folder / f"{name}.cubin"
    if not (man.exists() and cub.exists()):
        raise CubinsMissing(f"no cubin '{name}' for {arch} in {folder}: "
                            + BUILD_HINT.format(arch=arch))
    return json.loads(man.read_text()), cub


class Kernel:
    """One cubin's kernel, loaded once per process, its CUfunction fetched once per device."""

    def __init__(self, name: str, arch: str, args: list):
        self.manifest, path = load_manifest(name, arch)
        self.args = args
        self.sizes = [p[2] for p in self.manifest["params"]]
        expected = abi.param_sizes(args)
        if expected != self.sizes:
            raise RuntimeError(f"{name}: launcher parameters {expected} disagree with the cubin's "
                               f"{self.sizes}; rebuild with `make kernels`")
        self.block = tuple(self.manifest["block"])
        self.smem = int(self.manifest["dynamic_smem_bytes"])
        image = path.read_bytes()
        self._image = ctypes.create_string_buffer(image, len(image))
        cu = _cu()
        self._lib = check(cu.cuLibraryLoadData(ctypes.addressof(self._image), None, None, 0,
                                               None, None, 0))
        self._kernel = check(cu.cuLibraryGetKernel(self._lib, self.manifest["entry"].encode()))
        self._funcs: dict[int, object] = {}
        self._packed: dict[tuple, tuple] = {}

    def load(self, device: int) -> None:
        """Load the kernel on `device` now. A first load waits for the device to go idle, so a
        kernel launched while another waits on it (K1 alongside K2) must be loaded before."""
        self._function(device, self.smem)

    def _function(self, device: int, smem: int):
        """The kernel's CUfunction on `device`, allowed `smem` bytes of dynamic shared memory."""
        f, allowed = self._funcs.get(device, (None, 0))
        if f is None or smem > allowed:
            cu = _cu()
            if f is None:
                f = check(cu.cuKernelGetFunction(self._kernel))
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(f, attr, smem))
            self._funcs[device] = (f, smem)
        return f

    def launch_with(self, grid, values: dict, syms: dict, stream: int, device: int,
                    smem: int | None = None, programmatic: bool = False) -> None:
        """Pack `values` (see pack_params) and launch. The packed parameter block is cached by
        everything it is made of, so a repeated call (same tensors, shapes and scalars: a
        serving loop, a benchmark) skips the packing. `smem`: dynamic shared memory to reserve
        per CTA, at least the kernel's (more keeps other kernels' CTAs off its SMs).
        `programmatic`: launch as the programmatic dependent of the stream's previous kernel
        (it may start once every CTA of that kernel has run griddepcontrol.launch_dependents)."""
        key = (tuple(values.values()), tuple(syms.values()))
        arr = self._packed.get(key)
        if arr is None:
            arr = self._param_array(pack_params(self.args, values, syms))
            with _lock:
                if len(self._packed) >= _PACKED_MAX:
                    self._packed.clear()
                self._packed[key] = arr
        recorded(self._launch, grid, arr, stream, device, max(self.smem, smem or 0),
                 programmatic)

    def _param_array(self, params: list[bytes]):
        if [len(p) for p in params] != self.sizes:
            raise RuntimeError(f"{self.manifest['name']}: packed {[len(p) for p in params]}, "
                               f"cubin expects {self.sizes}")
        bufs = [ctypes.create_string_buffer(p, len(p)) for p in params]
        ptrs = (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
        return bufs, ptrs  # the buffers must outlive every launch that uses the pointers

    def _launch(self, grid, arr, stream: int, device: int, smem: int,
                programmatic: bool = False) -> None:
        cu = _cu()
        f = self._function(device, smem)
        if not programmatic:
            check(cu.cuLaunchKernel(f, *grid, *self.block, smem, cu.CUstream(stream),
                                    ctypes.addressof(arr[1]), 0))
            return
        attr = cu.CUlaunchAttribute()
        attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        conf = cu.CUlaunchConfig()
        conf.gridDimX, conf.gridDimY, conf.gridDimZ = grid
        conf.blockDimX, conf.blockDimY, conf.blockDimZ = self.block
        conf.sharedMemBytes = smem
        conf.hStream = cu.CUstream(stream)
        conf.attrs = [attr]
        conf.numAttrs = 1
        check(cu.cuLaunchKernelEx(conf, f, ctypes.addressof(arr[1]), 0))


_recorded = threading.local()


@contextlib.contextmanager
def recording():
    """Within the block, every Kernel.launch_with made by this thread, and every call made
    through `recorded`, is also appended to the list yielded as (function, arguments): what
    `replay` does again, skipping everything that led to it."""
    outer = getattr(_recorded, "steps", None)
    _recorded.steps = steps = []
    try:
        yield steps
    finally:
        _recorded.steps = outer


def recorded(fn, *args) -> None:
    """fn(*args), noted in this thread's recording if one is open."""
    steps = getattr(_recorded, "steps", None)
    if steps is not None:
        steps.append((fn, args))
    fn(*args)


def replay(steps: list) -> None:
    """Make recorded calls again, in order (their streams and devices as recorded)."""
    for fn, args in steps:
        fn(*args)


def memset_d32(ptr: int, value: int, count: int, stream: int) -> None:
    """`count` 32-bit words at `ptr` set to `value`, on `stream` (graph-capturable)."""
    cu = _cu()
    check(cu.cuMemsetD32Async(ptr, value, count, cu.CUstream(stream)))


def new_event() -> int:
    """A CUDA event without timing (for ordering streams), on the current context."""
    cu = _cu()
    ev = check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING))
    return int(ev)


def record_event(event: int, stream: int) -> None:
    """`event` marks the work enqueued on `stream` so far."""
    cu = _cu()
    check(cu.cuEventRecord(cu.CUevent(event), cu.CUstream(stream)))


def wait_event(stream: int, event: int) -> None:
    """Work enqueued on `stream` from now on waits for `event`'s last record (no host wait)."""
    cu = _cu()
    check(cu.cuStreamWaitEvent(cu.CUstream(stream), cu.CUevent(event), 0))


# ------------------------------------------------------------------------- TMA descriptors
_desc_cache: dict[tuple, bytes] = {}
_DESC_CACHE_MAX = 4096
_PACKED_MAX = 1024
_lock = threading.Lock()


def tma_descriptor(arg: abi.Arg, ptr: int, syms: dict) -> bytes:
    """128-byte CUtensorMap for a rank-2 tile load described by `arg` (one mode of stride 1)."""
    shape = [syms[e] if isinstance(e, str) else e for e in arg.shape]
    stride = [syms[e] if isinstance(e, str) else e for e in arg.stride]
    inner = arg.stride.index(1)
    cols, rows = shape[inner], shape[1 - inner]
    row_stride = stride[1 - inner]
    elem = abi.DTYPE_BYTES[arg.dtype]
    key = (arg.dtype, ptr, rows, cols, row_stride, arg.box, arg.swizzle)
    d = _desc_cache.get(key)
    if d is not None:
        return d
    d = encode_tiled(arg.dtype, ptr, (cols, rows), row_stride * elem, arg.box, arg.swizzle)
    with _lock:
        if len(_desc_cache) >= _DESC_CACHE_MAX:
            _desc_cache.clear()
        _desc_cache[key] = d
    return d


def encode_tiled(dtype: str, ptr: int, dims_inner_first, row_stride_bytes: int,
                 box_inner_first, swizzle: int = 0) -> bytes:
    cu = _cu()
    sw = cu.CUtensorMapSwizzle
    swz = {0: sw.CU_TENSOR_MAP_SWIZZLE_NONE, 32: sw.CU_TENSOR_MAP_SWIZZLE_32B,
           64: sw.CU_TENSOR_MAP_SWIZZLE_64B, 128: sw.CU_TENSOR_MAP_SWIZZLE_128B}[swizzle]
    dt = {"bfloat16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
          "float16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
          "float32": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[dtype]
    # rows of zero extent are legal tensors but not legal tensor maps
    dims = [max(1, int(x)) for x in dims_inner_first]
    tm = check(cu.cuTensorMapEncodeTiled(
        dt, 2, ptr,
        [cu.cuuint64_t(x) for x in dims],
        [cu.cuuint64_t(int(row_stride_bytes))],
        [cu.cuuint32_t(int(b)) for b in box_inner_first],
        [cu.cuuint32_t(1), cu.cuuint32_t(1)],
        cu.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        swz,
        cu.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
        cu.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE))
    return ctypes.string_at(tm.getPtr(), 128)


def pack_params(args: list, values: dict, syms: dict) -> list[bytes]:
    """values: name -> data pointer (tma/tensor) or Python number (scalars)."""
    params = []
    for a in args:
        if a.grid_only:
            continue
        if a.kind == "mma":
            params.append(b"\0")
            continue
        v = values[a.name]
        if a.kind == "tma":
            params.append(tma_descriptor(a, v, syms))
            coord = abi.pack_dynamic(a.shape, syms)
            if coord:
                params.append(coord)
        elif a.kind == "tensor":
            params.append(abi.pack_tensor(a, v, syms))
        else:
            params.append(abi.pack_scalar(a, v))
    return params


_kernels: dict[tuple, Kernel] = {}


def get_kernel(cfg, arch: str) -> Kernel:
    key = (cfg, arch)
    k = _kernels.get(key)
    if k is None:
        args = abi.args_for(cfg)
        with _lock:
            k = _kernels.get(key) or Kernel(cfg.name, arch, args)
            _kernels[key] = k
    return k
