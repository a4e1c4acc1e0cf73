"""The kernel-argument contract shared by the AOT build and the DSL-free launcher.

An argument list (`Arg`s, in `__call__` order) is written once per kernel family, in its spec
(kda_cute.specs). The build turns the list into fake tensors for `cute.compile`; the launcher
turns it into the raw kernel parameters. The CPU ABI tests check the parameter sizes against the
parameter table read back from each cubin, and each argument's `dsl` name against its position
in the DSL class's `__call__`.

Parameter layout rules (nvidia-cutlass-dsl 4.8, checked against every cubin by the ABI test):
- a TMA argument becomes two parameters: the 128-byte CUtensorMap (by value) and the TMA
  coordinate tensor, which holds only the tensor's dynamic shape entries;
- a tensor argument becomes one struct {u64 pointer; dynamic shape entries; dynamic stride
  entries} with natural alignment, its size rounded up to 8;
- i32 / f32 scalars are 4 bytes; a TiledMma passed to the kernel is its 1-byte accumulate flag
  (the kernel sets it before every MMA); static shapes and layouts vanish;
- `grid_only` arguments size the launch grid and are not kernel parameters.
"""

from __future__ import annotations

import re
import struct
from dataclasses import asdict, dataclass

# Dynamic dimensions: name -> bit width. One name is one run-time value within a kernel.
SYM_WIDTH = {
    "T": 32, "R": 32, "H": 32, "HK": 32, "HV": 32, "HC": 32, "NCH": 32, "N1": 32, "NS": 32,
    "FL": 32,
    "sQ": 64, "sK": 64, "sG": 64, "sB": 64, "sV": 64, "sO": 64, "sS": 64, "sW": 32, "sWc": 32,
    "NSP": 32, "sSP": 64,
    # the token step: pool slots and written rows, their strides, the index tables' lengths
    "P": 32, "PD": 32, "sP": 64, "sPD": 64,
    "NCU": 32, "NRI": 32, "NWI": 32, "NAC": 32, "NPA": 32, "NHI": 32,
    # the offsets: the caller's cu_seqlens in int32 words; the shifted K1 tables (2N + 1); the
    # segments' tables (N P + 1)
    "NCW": 32, "N2": 32, "NSP1": 32,
    # checkpoints: K2's table, the destination's rows and row stride, the scratch rows; the
    # caller's entries and first offsets (int32 words), the side tables
    "NCT": 32, "NCK": 32, "sCK": 64, "NSK": 32, "NCE": 32, "NCF": 32, "NSC": 32,
    # the rescale words of K2 (kda_cute.specs.recur.rescale_args)
    "NFX": 32,
    # the replay step's ring: its tensors' slot strides
    "sRK": 64, "sRR": 64, "sRU": 64, "sRG": 64,
}
# divisibility promised to the compiler; the launcher validates it
SYM_DIV = {"sQ": 8, "sK": 8, "sG": 8, "sV": 8, "sO": 8, "sW": 8, "sWc": 8, "sP": 8, "sPD": 8,
           "sCK": 8, "sS": 8, "sRK": 8, "sRU": 8, "sRG": 4, "sRR": 4}

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4, "int8": 1}

# The dtype a gate parameter (A_log, dt_bias) is held in, passed at run time beside it (K1's and
# the token step's `a_log_dtype` / `dt_bias_dtype`): the argument is declared fp32 and read in
# the caller's dtype, so a model cast to bf16 or fp16 runs without a conversion launch; 0 (no
# parameter) reads zeros
GATE_PARAM_DTYPES = {"float32": 1, "bfloat16": 2, "float16": 3}


@dataclass(frozen=True)
class Arg:
    name: str
    kind: str  # "tma" | "tensor" | "i32" | "f32" | "mma" (a TiledMma: its 1-byte accumulate flag)
    dtype: str = ""
    shape: tuple = ()
    stride: tuple = ()
    box: tuple = ()  # TMA box, innermost first
    swizzle: int = 0  # TMA smem swizzle span in bytes (0, 32, 64, 128)
    align: int = 4
    grid_only: bool = False
    kernel_only: bool = False  # made inside __call__ (a TiledMma), not one of its arguments
    # the DSL `__call__` parameter this argument is passed as ("" for a kernel_only one):
    # `m` + the name in CamelCase for a tensor (q -> mQ, dt_bias -> mDtBias), the name itself
    # for a scalar, unless the spec says otherwise
    dsl: str = ""

    def __post_init__(self):
        if not self.dsl and not self.kernel_only:
            camel = "".join(w[:1].upper() + w[1:] for w in self.name.split("_"))
            object.__setattr__(self, "dsl", "m" + camel if self.kind in ("tma", "tensor")
                               else self.name)

    def dynamic(self, entries) -> list[str]:
        return [e for e in entries if isinstance(e, str)]


class SpecConfig:
    """What every spec's config dataclass has: the threads of its CTA (`threads`, where the
    config says no other) and its fields as a dict (the build's manifest and cache key)."""

    @property
    def block_threads(self) -> int:
        return self.threads

    def as_dict(self) -> dict:
        return asdict(self)


def operand_dtype(f16: bool) -> str:
    """The workspace operands' dtype name: fp16 for the f16 (fast) builds, else bf16."""
    return "float16" if f16 else "bfloat16"


# qg and kg (the gated q and k: |entries| <= 1 for unit-norm keys and queries, decays <= 1) are
# fp16 in every tensor-core build: P = S kg^T and Pq = S qg^T run on fp16 operands, the
# precise builds' S scaled per row by a power of two into fp16's range
QK_DTYPE = "float16"


def tma(name, dtype, shape, stride, box, swizzle=0, dsl=""):
    """A TMA-loaded (or stored) argument: a tile view with one mode of stride 1 (rank 2, or
    rank 3: the checkpoints' [rows, H*V, K]), its box innermost first."""
    return Arg(name, "tma", dtype, shape, stride, box, swizzle, align=16, dsl=dsl)


def operand_tma(name, cols, rows, inner, mn_major=False, dtype="bfloat16"):
    """A 16-bit (bf16; fp16 for the f16 configs) MMA operand tile of K1's workspace (R rows:
    whole chunks) loaded by TMA into a swizzled smem layout: `inner` contiguous elements per
    row, `rows` rows. The swizzle span is the row's bytes (32, 64 or 128); rows of more than 128
    bytes are loaded as several 128-byte-wide boxes. An MN-major operand (kd) is declared as
    the transposed view (cols, R) of the same row-major tensor."""
    span = min(128, inner * 2)
    shape, stride = ((cols, "R"), (1, cols)) if mn_major else (("R", cols), (cols, 1))
    return tma(name, dtype, shape, stride, (span // 2, rows), span)


def ws_tile(name, dtype, cols, box):
    """A plain (unswizzled) tile of K1's workspace, rows of whole chunks, by TMA."""
    return tma(name, dtype, ("R", cols), (cols, 1), box)


def ws_rows(name, dtype, width, stride):
    """K1's workspace as (R, H, width) rows of whole chunks, written by the threads; `stride`
    names the row stride H * width (sW for K-wide rows, sWc for chunk-wide ones)."""
    return tensor(name, dtype, ("R", "H", width), (stride, width, 1), 16)


def tensor(name, dtype, shape, stride, align=None, dsl=""):
    """An argument passed as a tensor struct {pointer, dynamic shape, dynamic strides}."""
    return Arg(name, "tensor", dtype, shape, stride, align=align or DTYPE_BYTES[dtype], dsl=dsl)


def scalar(name, kind="i32", grid_only=False):
    """An i32 / f32 scalar argument (`grid_only`: sizes the grid, not a kernel parameter)."""
    return Arg(name, kind, grid_only=grid_only)


# ------------------------------------------------------------------------------------ packing
def _struct(fields, align: int = 1) -> bytes:
    """(format, value) fields as a C struct: each at its natural alignment, the whole rounded up
    to its largest field (at least `align`)."""
    buf = bytearray()
    for fmt, value in fields:
        size = struct.calcsize(fmt)
        buf += b"\0" * (-len(buf) % size) + struct.pack("<" + fmt, value)
        align = max(align, size)
    return bytes(buf + b"\0" * (-len(buf) % align))


def _dynamic(entries, syms: dict) -> list[tuple[str, int]]:
    return [("q" if SYM_WIDTH[e] == 64 else "i", syms[e]) for e in entries if isinstance(e, str)]


def pack_dynamic(entries, syms: dict) -> bytes:
    """The coordinate tensor of a TMA argument: its dynamic shape entries."""
    return _struct(_dynamic(entries, syms))


def pack_tensor(arg: Arg, ptr: int, syms: dict) -> bytes:
    return _struct([("Q", ptr), *_dynamic(arg.shape + arg.stride, syms)], 8)


def params(args: list[Arg]) -> list[tuple[str, str, int]]:
    """The kernel parameters the list produces, in order: (argument, role, size in bytes), the
    role one of "tma_descriptor", "tma_coordinates", "tensor", "mma_flag", "i32", "f32"."""
    zeros = dict.fromkeys(SYM_WIDTH, 0)
    out = []
    for a in args:
        if a.grid_only:
            continue
        if a.kind == "tma":
            out.append((a.name, "tma_descriptor", 128))
            out.append((a.name, "tma_coordinates", len(pack_dynamic(a.shape, zeros))))
        elif a.kind == "tensor":
            out.append((a.name, "tensor", len(pack_tensor(a, 0, zeros))))
        elif a.kind == "mma":
            out.append((a.name, "mma_flag", 1))
        else:
            out.append((a.name, a.kind, 4))
    # a TMA coordinate tensor without dynamic entries produces no parameter
    return [p for p in out if p[2]]


def param_sizes(args: list[Arg]) -> list[int]:
    """Sizes of the kernel parameters the list produces, in order (all syms set to 0)."""
    return [size for _, _, size in params(args)]


def pack_scalar(arg: Arg, value) -> bytes:
    return struct.pack("<i" if arg.kind == "i32" else "<f", value)


def c_ident(name: str) -> str:
    """A kernel's name as the C identifier the exported headers give it (kda-cute export,
    kda-cute plan)."""
    return re.sub(r"[^0-9A-Za-z_]", "_", name)
