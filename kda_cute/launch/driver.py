"""The CUDA driver side: cubins loaded once, TMA descriptors encoded and cached, parameters
packed and cached, kernels launched with cuLaunchKernel(Ex). Only torch and cuda.bindings are
needed at run time (no DSL).

`substitute(fake)` routes every driver call to `fake` (an object with the cuda.bindings.driver
functions this module calls; `StandIn` has what every such object answers alike) within its
block: the way the tests and kda_cute.plan_export see, on a machine without a GPU, exactly what
would be handed to the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading

from .. import abi
from ..cubin import load_manifest
from ..specs import args_for

_substitute: list = []


def bindings():
    """The driver module in use: cuda.bindings.driver, or the substitute."""
    if _substitute:
        return _substitute[-1]
    from cuda.bindings import driver
    return driver


class Namespace:
    """Attributes from keywords (the driver's structs and result codes, as a stand-in gives
    them)."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class _OwnNames:
    """Any attribute is its own name (the driver's enum members, as a stand-in sees them)."""

    def __getattr__(self, name):
        return name


class StandIn:
    """The part of cuda.bindings.driver that a stand-in for `substitute` answers the same way
    whatever it records: the enums this module reads, the handle and integer casts, the launch
    config structs, and the library -> kernel -> function handles as one number. A recorder
    subclasses it and adds the calls it records (loads, attributes, launches, memsets,
    descriptors, events)."""

    CUresult = Namespace(CUDA_SUCCESS=0)
    CUfunction_attribute = CUlaunchAttributeID = CUevent_flags = CUstream_flags = _OwnNames()
    CUtensorMapSwizzle = Namespace(
        CU_TENSOR_MAP_SWIZZLE_NONE=0, CU_TENSOR_MAP_SWIZZLE_32B=32,
        CU_TENSOR_MAP_SWIZZLE_64B=64, CU_TENSOR_MAP_SWIZZLE_128B=128)
    CUtensorMapDataType = Namespace(
        CU_TENSOR_MAP_DATA_TYPE_BFLOAT16="bfloat16", CU_TENSOR_MAP_DATA_TYPE_FLOAT16="float16",
        CU_TENSOR_MAP_DATA_TYPE_FLOAT32="float32")
    CUtensorMapInterleave = CUtensorMapL2promotion = CUtensorMapFloatOOBfill = _OwnNames()

    CUstream = CUevent = cuuint64_t = cuuint32_t = staticmethod(int)  # noqa: N815

    def CUlaunchAttribute(self):  # noqa: N802 (the driver's names)
        return Namespace(id=None, value=Namespace())

    def CUlaunchConfig(self):  # noqa: N802
        return Namespace()

    def cuLibraryGetKernel(self, lib, entry):  # noqa: N802
        return 0, lib

    def cuKernelGetFunction(self, kernel):  # noqa: N802
        return 0, kernel


def image_size(addr: int) -> int:
    """The size of the ELF image (a cubin) at `addr`, from its header alone (what a stand-in's
    cuLibraryLoadData reads to know which cubin it was handed)."""
    head = ctypes.string_at(addr, 64)
    phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
    return max(phoff + phentsize * phnum, shoff + shentsize * shnum)


# (set_aside, put_back) pairs of the modules that keep driver objects (the launcher's streams
# and events: kda_cute.launch.streams registers itself), so this module imports none of them
_holders: list = []


def holds_driver_objects(set_aside, put_back) -> None:
    """Register a module's driver objects: `set_aside()` returns them, forgotten, on entering a
    substitute's block, `put_back(held)` restores them on leaving it."""
    _holders.append((set_aside, put_back))


@contextlib.contextmanager
def substitute(fake):
    """Within the block, every driver call goes to `fake`; kernels loaded and descriptors
    encoded are forgotten on entry and exit, and the launcher's streams and events set aside on
    entry and put back on exit (they belong to one driver)."""
    clear()
    held = [(put_back, set_aside()) for set_aside, put_back in _holders]
    _substitute.append(fake)
    try:
        yield fake
    finally:
        _substitute.pop()
        clear()
        for put_back, h in reversed(held):
            put_back(h)


def check(res):
    """cuda.bindings returns (err, *values): raise on error, return the values."""
    cu = bindings()
    if not isinstance(res, tuple):
        res = (res,)
    err, vals = res[0], res[1:]
    if err != cu.CUresult.CUDA_SUCCESS:
        _, msg = cu.cuGetErrorString(err)
        raise RuntimeError(f"CUDA driver error {getattr(err, 'name', err)}: "
                           f"{msg.decode() if msg else ''}")
    if not vals:
        return None
    return vals[0] if len(vals) == 1 else vals


_lock = threading.Lock()
_PACKED_MAX = 1024


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
        image = path.read_bytes()
        self._image = ctypes.create_string_buffer(image, len(image))
        cu = bindings()
        self._lib = check(cu.cuLibraryLoadData(ctypes.addressof(self._image), None, None, 0,
                                               None, None, 0))
        self._kernel = check(cu.cuLibraryGetKernel(self._lib, self.manifest["entry"].encode()))
        self._funcs: dict[int, object] = {}
        self._packed: dict[tuple, tuple] = {}

    def function(self, device: int, smem: int):
        """The kernel's CUfunction on `device`, allowed `smem` bytes of dynamic shared memory.
        A first load waits for the device to go idle: a run loads every kernel of its plan
        before launching any (K1 alongside K2 waits on nothing, K2 waits on K1)."""
        f, allowed = self._funcs.get(device, (None, 0))
        if f is None or smem > allowed:
            cu = bindings()
            if f is None:
                f = check(cu.cuKernelGetFunction(self._kernel))
            attr = cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(cu.cuFuncSetAttribute(f, attr, smem))
            self._funcs[device] = (f, smem)
        return f

    def packed(self, names: tuple, values: tuple, syms: tuple):
        """The parameter block of `values` (by argument `names`: data pointers for tensors and
        TMA arguments, numbers for scalars) and dynamic dimensions `syms`, packed once per
        distinct block (a repeated call, a serving loop or a benchmark, skips the packing)."""
        key = (values, syms)
        arr = self._packed.get(key)
        if arr is None:
            params = pack_params(self.args, dict(zip(names, values, strict=True)), dict(syms))
            if [len(p) for p in params] != self.sizes:
                raise RuntimeError(f"{self.manifest['name']}: packed {[len(p) for p in params]}, "
                                   f"cubin expects {self.sizes}")
            bufs = [ctypes.create_string_buffer(p, len(p)) for p in params]
            # (the buffers must outlive every launch that uses the pointers)
            arr = bufs, (ctypes.c_void_p * len(bufs))(*[ctypes.addressof(b) for b in bufs])
            with _lock:
                if len(self._packed) >= _PACKED_MAX:
                    self._packed.clear()
                self._packed[key] = arr
        return arr

    def launch(self, f, grid, arr, stream: int, smem: int, programmatic: bool = False) -> None:
        """Launch CUfunction `f` (from `function`) with a packed block `arr` on `stream`.
        `programmatic`: as the programmatic dependent of the stream's previous kernel (it may
        start once every CTA of that kernel has run griddepcontrol.launch_dependents)."""
        cu = bindings()
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


def memset_d32(ptr: int, value: int, count: int, stream: int) -> None:
    """`count` 32-bit words at `ptr` set to `value`, on `stream` (graph-capturable)."""
    cu = bindings()
    check(cu.cuMemsetD32Async(ptr, value, count, cu.CUstream(stream)))


def new_event() -> int:
    """A CUDA event without timing (for ordering streams), on the current context."""
    cu = bindings()
    return int(check(cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)))


def new_stream(first: bool = False) -> int:
    """A CUDA stream that does not wait for the legacy default stream, on the current
    context; `first`: of the greatest priority (the device's scheduler hands its blocks to SMs
    before those of streams of lower priority)."""
    cu = bindings()
    flags = cu.CUstream_flags.CU_STREAM_NON_BLOCKING
    if not first:
        return int(check(cu.cuStreamCreate(flags)))
    _, greatest = check(cu.cuCtxGetStreamPriorityRange())
    return int(check(cu.cuStreamCreateWithPriority(flags, greatest)))


def record_event(event: int, stream: int) -> None:
    """`event` marks the work enqueued on `stream` so far."""
    cu = bindings()
    check(cu.cuEventRecord(cu.CUevent(event), cu.CUstream(stream)))


def wait_event(stream: int, event: int) -> None:
    """Work enqueued on `stream` from now on waits for `event`'s last record (no host wait)."""
    cu = bindings()
    check(cu.cuStreamWaitEvent(cu.CUstream(stream), cu.CUevent(event), 0))


# ------------------------------------------------------------------------- TMA descriptors
_desc_cache: dict[tuple, bytes] = {}
_DESC_CACHE_MAX = 4096


def tma_descriptor(arg: abi.Arg, ptr: int, syms: dict) -> bytes:
    """128-byte CUtensorMap for the tile view described by `arg` (one mode of stride 1, the
    innermost; the others outermost last, as the DSL's atoms order them)."""
    shape = [syms[e] if isinstance(e, str) else e for e in arg.shape]
    stride = [syms[e] if isinstance(e, str) else e for e in arg.stride]
    inner = arg.stride.index(1)
    order = [inner] + [i for i in reversed(range(len(shape))) if i != inner]
    elem = abi.DTYPE_BYTES[arg.dtype]
    dims = tuple(shape[i] for i in order)
    strides = tuple(stride[i] * elem for i in order[1:])
    key = (arg.dtype, ptr, dims, strides, arg.box, arg.swizzle)
    d = _desc_cache.get(key)
    if d is not None:
        return d
    d = encode_tiled(arg.dtype, ptr, dims, strides, arg.box, arg.swizzle)
    with _lock:
        if len(_desc_cache) >= _DESC_CACHE_MAX:
            _desc_cache.clear()
        _desc_cache[key] = d
    return d


def encode_tiled(dtype: str, ptr: int, dims_inner_first, strides_bytes,
                 box_inner_first, swizzle: int = 0) -> bytes:
    """A tiled CUtensorMap: `dims_inner_first` (the innermost contiguous), the byte strides of
    the modes after the first, the box and smem swizzle."""
    cu = bindings()
    sw = cu.CUtensorMapSwizzle
    swz = {0: sw.CU_TENSOR_MAP_SWIZZLE_NONE, 32: sw.CU_TENSOR_MAP_SWIZZLE_32B,
           64: sw.CU_TENSOR_MAP_SWIZZLE_64B, 128: sw.CU_TENSOR_MAP_SWIZZLE_128B}[swizzle]
    dt = {"bfloat16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
          "float16": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
          "float32": cu.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32}[dtype]
    # rows of zero extent are legal tensors but not legal tensor maps
    dims = [max(1, int(x)) for x in dims_inner_first]
    rank = len(dims)
    tm = check(cu.cuTensorMapEncodeTiled(
        dt, rank, ptr,
        [cu.cuuint64_t(x) for x in dims],
        [cu.cuuint64_t(int(x)) for x in strides_bytes],
        [cu.cuuint32_t(int(b)) for b in box_inner_first],
        [cu.cuuint32_t(1)] * rank,
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
        with _lock:
            k = _kernels.get(key) or Kernel(cfg.name, arch, args_for(cfg))
            _kernels[key] = k
    return k


# counts the clears: what was resolved against the kernels of an earlier generation (the
# launcher's resolved steps) is not used again
generation = 0


def clear() -> None:
    """Forget loaded kernels, packed blocks and encoded descriptors."""
    global generation
    _kernels.clear()
    _desc_cache.clear()
    generation += 1
