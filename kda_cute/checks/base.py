"""The checks every call shares, each raising ValueError / TypeError that names the argument the
caller passed, what was expected and what was got: tensors, state pools and their slot tables,
switches, the gate parameters and the call's scalars."""

from __future__ import annotations

import functools
import math

import torch

from ..abi import GATE_PARAM_DTYPES
from ..problem import STATE_DTYPES


def err(name: str, expected: str, got) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {got}")


def _dtype_name(d) -> str:
    return str(d).replace("torch.", "")


def tensor(name, t, dtypes, ndim=None, device=None, shape=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        exp = " or ".join(_dtype_name(d) for d in dtypes)
        raise TypeError(f"{name}: expected dtype {exp}, got {_dtype_name(t.dtype)}")
    if t.layout != torch.strided:  # (a sparse tensor's strides read as zeros)
        raise TypeError(f"{name}: expected a dense (strided) tensor, got layout {t.layout}")
    if ndim is not None and t.dim() != ndim:
        raise err(name, f"a {ndim}-d tensor", f"shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise err(name, f"a tensor on {device}", f"one on {t.device}")
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise err(name, f"shape {tuple(shape)}", f"{tuple(t.shape)}")


# ---------------------------------------------------------------- state pools and slot indices
INDEX_DTYPES = (torch.int32, torch.int64)
POOL_DTYPES = STATE_DTYPES


def pool(name, t, H, V, K, dev, ndim=4):
    """A state pool [..., slots, H, V, K] (fp32 or bf16, each slot's [H, V, K] dense, the slot
    stride free: a multiple of 8 elements, >= H*V*K): its slot stride in elements."""
    tensor(name, t, POOL_DTYPES, ndim, dev)
    inner = tuple(t.shape[ndim - 3:])
    if inner != (H, V, K):
        raise err(name, f"shape [..., {H}, {V}, {K}]", tuple(t.shape))
    if t.stride()[ndim - 3:] != (V * K, K, 1):
        raise err(name, f"each slot's [H, V, K] dense (strides (..., {V * K}, {K}, 1))",
                  f"strides {tuple(t.stride())}")
    s = t.stride(ndim - 4) if t.shape[ndim - 4] > 1 else H * V * K
    if s % 8 or s < H * V * K:
        raise err(name, f"a slot stride >= H*V*K = {H * V * K} and a multiple of 8 elements",
                  s)
    return s


def index_table(name, t, shape, dev):
    """An int32 / int64 table of `shape` (None entries: any): its strides in elements."""
    tensor(name, t, INDEX_DTYPES, len(shape), dev)
    if any(w is not None and w != g for w, g in zip(shape, t.shape, strict=True)):
        want = tuple("*" if w is None else w for w in shape)
        raise err(name, f"shape {want}", tuple(t.shape))
    return tuple(t.stride(i) if t.shape[i] > 1 else 0 for i in range(t.dim()))


def index_words(t) -> int:
    """The int32 words an index table spans (0 for None; an int64 entry is two)."""
    if t is None:
        return 0
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) \
        if t.numel() else 1
    return span * (2 if t.dtype == torch.int64 else 1)


def is_wide(t) -> int:
    """1 for an int64 index table (read as word pairs), else 0."""
    return int(t is not None and t.dtype == torch.int64)


def flags(name, t, n: int, dev) -> None:
    """A contiguous bool / int8 / uint8 tensor of `n` per-row flags (has_initial_state)."""
    tensor(name, t, (torch.bool, torch.int8, torch.uint8), 1, dev)
    if t.numel() != n or not t.is_contiguous():
        raise err(name, f"a contiguous tensor of {n} flags",
                  f"shape {tuple(t.shape)}, strides {tuple(t.stride())}")


def flag(name: str, v) -> bool:
    """A switch: a bool, an int 0 or 1 (numpy's scalars too), or None (off); anything else (a
    tensor, a list, a string) is refused rather than read by its truth value."""
    if v is None or isinstance(v, bool):
        return bool(v)
    numpy_scalar = (type(v).__module__ == "numpy" and getattr(v, "ndim", 1) == 0
                    and v.dtype.kind in "biu")
    if (isinstance(v, int) or numpy_scalar) and v in (0, 1):
        return bool(v)
    raise TypeError(f"{name}: expected a bool, got {type(v).__name__} {str(v)[:40]}")


def null_min(null_slot) -> int:
    """The least index that is not padding: 0, or 1 with null_slot=0 (vLLM's null block)."""
    if null_slot is None:
        return 0
    if isinstance(null_slot, bool) or not isinstance(null_slot, (int, float)) or null_slot != 0:
        raise err("null_slot", "None or 0 (index 0 marks padding too)", repr(null_slot))
    return 1


# the dtypes a gate parameter may be held in (the kernels read each as held)
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def gate_params(A_log, dt_bias, gate: str, H: int, K: int, dev) -> tuple[int, int]:
    """A_log [H] and dt_bias [H, K] (or [H*K]), each None or a contiguous fp32, bf16 or fp16
    tensor on `dev`; A_log is needed by the unbounded gate. The gate "none" reads neither
    (given ones must still be tensors). Returns how each is held, the code the kernels read
    (abi.GATE_PARAM_DTYPES; 0: not given or not read). One check for every call."""
    if gate == "none":
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None and not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor or None, got "
                                f"{type(t).__name__}")
        return 0, 0
    if A_log is None and gate == "unbounded":
        raise err("A_log", f"a tensor [{H}] (float32, bfloat16 or float16) for the unbounded "
                  "gate", None)
    codes = []
    for name, t, n, want in (("A_log", A_log, H, f"[{H}]"),
                             ("dt_bias", dt_bias, H * K, f"[{H}, {K}] or [{H * K}]")):
        if t is None:
            codes.append(0)
            continue
        tensor(name, t, GATE_DTYPES, None, dev)
        if t.numel() != n or not t.is_contiguous():
            raise err(name, f"a contiguous tensor {want} ({n} elements)",
                      f"shape {tuple(t.shape)}, strides {tuple(t.stride())}")
        codes.append(GATE_PARAM_DTYPES[_dtype_name(t.dtype)])
    return codes[0], codes[1]


def scalars(scale, lower_bound, gate: str, K: int | None = None) -> tuple[float, float | None]:
    """scale (None: K ** -0.5 where the call defaults it, given K) and lower_bound (a float in
    [-5, 0) for the bounded gate, else a float or None), as floats. One check for every
    call."""
    if scale is None and K is not None:
        scale = K ** -0.5
    if (isinstance(scale, bool) or not isinstance(scale, (int, float))
            or not math.isfinite(scale) or scale <= 0):
        raise err("scale", "a finite positive float", repr(scale))
    if gate == "bounded":
        if (isinstance(lower_bound, bool) or not isinstance(lower_bound, (int, float))
                or not -5.0 <= lower_bound < 0.0):
            raise err("lower_bound", "a float in [-5, 0) for the bounded gate",
                      repr(lower_bound))
    elif lower_bound is not None and (isinstance(lower_bound, bool)
                                      or not isinstance(lower_bound, (int, float))):
        raise err("lower_bound", "a float or None", repr(lower_bound))
    return float(scale), (None if lower_bound is None else float(lower_bound))


def on_cuda(dev, what: str) -> None:
    """The call's tensors are on a CUDA device (`what`: the argument that tells)."""
    if dev.type != "cuda":
        raise err(what, "a CUDA tensor", f"one on {dev}")


def has_address(t) -> bool:
    """Whether `t` is a tensor with memory: not None, not a FakeTensor."""
    return t is not None and not isinstance(t, _fake_tensor())


@functools.cache
def _fake_tensor():
    from torch._subclasses.fake_tensor import FakeTensor
    return FakeTensor


def capturing(dev) -> bool:
    """Whether `dev`'s current stream is being captured into a CUDA graph."""
    if dev.type != "cuda":
        return False
    with torch.cuda.device(dev):
        return torch.cuda.is_current_stream_capturing()
