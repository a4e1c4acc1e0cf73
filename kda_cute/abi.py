"""The kernel-argument contract shared by the AOT build and the DSL-free launcher.

Each kernel's `__call__` arguments are listed once, here, in order. The build turns the list into
fake tensors for `cute.compile`; the launcher turns it into the raw kernel parameters. The CPU ABI
test checks the parameter sizes against the parameter table read back from each cubin.

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

import struct
from dataclasses import dataclass, field

from .config import CombineConfig, PrepConfig, RecurConfig, operand_dtype

# Dynamic dimensions: name -> bit width. One name is one run-time value within a kernel.
SYM_WIDTH = {
    "T": 32, "R": 32, "H": 32, "HK": 32, "HV": 32, "HC": 32, "NCH": 32, "N1": 32, "NS": 32,
    "FL": 32,
    "sQ": 64, "sK": 64, "sG": 64, "sB": 64, "sV": 64, "sO": 64, "sS": 64, "sW": 32, "sWc": 32,
    "NSP": 32,
}
# divisibility promised to the compiler; the launcher validates it
SYM_DIV = {"sQ": 8, "sK": 8, "sG": 8, "sV": 8, "sO": 8, "sW": 8, "sWc": 8}

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "int32": 4}


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

    def dynamic(self, entries) -> list[str]:
        return [e for e in entries if isinstance(e, str)]


def _tma(name, dtype, shape, stride, box, swizzle=0):
    return Arg(name, "tma", dtype, shape, stride, box, swizzle, align=16)


def _operand_tma(name, cols, rows, inner, mn_major=False, dtype="bfloat16"):
    """A 16-bit (bf16; fp16 for the f16 configs) MMA operand tile of K1's workspace (R rows:
    whole chunks) loaded by TMA into a swizzled smem layout: `inner` contiguous elements per
    row, `rows` rows. The swizzle span is the row's bytes (32, 64 or 128); rows of more than 128
    bytes are loaded as several 128-byte-wide boxes. An MN-major operand (kd) is declared as
    the transposed view (cols, R) of the same row-major tensor."""
    span = min(128, inner * 2)
    shape, stride = ((cols, "R"), (1, cols)) if mn_major else (("R", cols), (cols, 1))
    return _tma(name, dtype, shape, stride, (span // 2, rows), span)


def _ws_tile(name, dtype, cols, box):
    """A plain (unswizzled) tile of K1's workspace, rows of whole chunks, by TMA."""
    return _tma(name, dtype, ("R", cols), (cols, 1), box)


def _ws_rows(name, dtype, width, stride):
    """K1's workspace as (R, H, width) rows of whole chunks, written by the threads; `stride`
    names the row stride H * width (sW for K-wide rows, sWc for chunk-wide ones)."""
    return _ten(name, dtype, ("R", "H", width), (stride, width, 1), 16)


def _ten(name, dtype, shape, stride, align=None):
    return Arg(name, "tensor", dtype, shape, stride, align=align or DTYPE_BYTES[dtype])


def prep_args(cfg: PrepConfig) -> list[Arg]:
    K, C = cfg.head_dim_k, cfg.chunk
    gl = _ten("gl", "float32", ("NCH", "H", K), ("sW", K, 1), 16)
    if cfg.operands == "bf16":
        # TMA stores from smem: (C, K) tiles of qg and kg; kd's, Aw's and Mq's planes by the
        # threads (fp16 throughout for the f16 configs, which write no lo planes)
        dt = operand_dtype(cfg.f16)
        outs = [_ws_tile("qg", dt, "HK", (K, C)), _ws_tile("kg", dt, "HK", (K, C)),
                *(_ws_rows(n, dt, K, "sW") for n in ("kdh", "kdl")),
                *(_ws_rows(n, dt, C, "sWc") for n in ("awh", "awl", "mqh", "mql")), gl]
    else:
        outs = [*(_ws_rows(n, "float32", K, "sW") for n in ("qg", "kg", "kd")), gl,
                *(_ws_rows(n, "float32", C, "sWc") for n in ("aw", "mq"))]
    return [
        _tma("q", "bfloat16", ("T", "HK"), ("sQ", 1), (K, C)),
        _tma("k", "bfloat16", ("T", "HK"), ("sK", 1), (K, C)),
        _tma("g", "bfloat16", ("T", "HK"), ("sG", 1), (K, C)),
        _ten("beta", "bfloat16", ("T", "H"), ("sB", 1)),
        _ten("A_log", "float32", ("H",), (1,)),
        _ten("dt_bias", "float32", ("HK",), (1,)),
        _ten("cu_seqlens", "int32", ("N1",), (1,)),
        _ten("cu_chunks", "int32", ("N1",), (1,)),
        *outs,
        _ten("flags", "int32", ("FL",), (1,)),  # written only by an alongside build
        Arg("num_seqs", "i32"),
        Arg("seq_len", "i32"),  # a fixed-length batch's T (K1 finds its chunks by arithmetic)
        Arg("num_chunks", "i32", grid_only=True),
        Arg("num_heads", "i32", grid_only=True),
        Arg("scale", "f32"),
        Arg("lower_bound", "f32"),
        Arg("gate_mode", "i32"),
        Arg("qk_l2norm", "i32"),
        Arg("beta_sigmoid", "i32"),
    ]


def recur_args(cfg: RecurConfig) -> list[Arg]:
    K, C = cfg.head_dim_k, cfg.chunk
    if cfg.mma == "wgmma":
        dt = operand_dtype(cfg.f16)
        return [
            _operand_tma("kg", "HK", C, K, dtype=dt),
            _operand_tma("qg", "HK", C, K, dtype=dt),
            _operand_tma("kdh", "HK", C, K, mn_major=True, dtype=dt),
            _operand_tma("kdl", "HK", C, K, mn_major=True, dtype=dt),
            _operand_tma("awh", "HC", C, C, dtype=dt),
            _operand_tma("awl", "HC", C, C, dtype=dt),
            _operand_tma("mqh", "HC", C, C, dtype=dt),
            _operand_tma("mql", "HC", C, C, dtype=dt),
            *_recur_common(cfg),
            Arg("mma_p", "mma", kernel_only=True),
            Arg("mma_s", "mma", kernel_only=True),
        ]
    return [
        _ws_tile("kg", "float32", "HK", (K, C)),
        _ws_tile("qg", "float32", "HK", (K, C)),
        _ws_tile("kd", "float32", "HK", (K, C)),
        _ws_tile("aw", "float32", "HC", (C, C)),
        _ws_tile("mq", "float32", "HC", (C, C)),
        *_recur_common(cfg),
    ]


def _recur_common(cfg: RecurConfig) -> list[Arg]:
    K, V, C, BV = cfg.head_dim_k, cfg.head_dim_v, cfg.chunk, cfg.block_v
    return [
        _tma("gl", "float32", ("NCH", "HK"), ("HK", 1), (K, 1)),
        _tma("v", "bfloat16", ("T", "HV"), ("sV", 1), (BV, C)),
        _ten("out", "bfloat16", ("T", "H", V), ("sO", V, 1)),
        *([_tma("out_tma", "bfloat16", ("T", "HV"), ("sO", 1), (16, C))]
          if cfg.mma == "wgmma" else []),
        _ten("s0f", "float32", ("NS", "H", V, K), ("sS", V * K, K, 1)),
        _ten("s0h", "bfloat16", ("NS", "H", V, K), ("sS", V * K, K, 1)),
        _ten("s1f", "float32", ("NS", "H", V, K), ("sS", V * K, K, 1)),
        _ten("s1h", "bfloat16", ("NS", "H", V, K), ("sS", V * K, K, 1)),
        _ten("cu_seqlens", "int32", ("N1",), (1,)),
        _ten("cu_chunks", "int32", ("N1",), (1,)),
        # read only by an alongside build
        *([_ten("flags", "int32", ("FL",), (1,))] if cfg.mma == "wgmma" else []),
        Arg("num_seqs", "i32", grid_only=True),
        Arg("num_heads", "i32", grid_only=True),
        Arg("state_in", "i32"),
        Arg("state_out", "i32"),
        # 1: grid z runs the z-th longest sequence (varlen, fewer than the CTA's threads)
        *([Arg("ordered", "i32")] if cfg.mma == "wgmma" else []),
    ]


def combine_args(cfg: CombineConfig) -> list[Arg]:
    """The segments' combine: NSP = sequences x segments, NS = sequences, sS = H * K * K."""
    K = cfg.head_dim_k

    def states(name, rows):
        return _ten(name, "float32", (rows, "H", K, K), ("sS", K * K, K, 1))

    return [
        states("maps", "NSP"), states("ends", "NSP"), states("s0", "NS"),
        states("starts", "NSP"), states("final", "NS"),
        Arg("segments", "i32"),
        Arg("has_init", "i32"),
        Arg("has_final", "i32"),
        Arg("num_seqs", "i32", grid_only=True),
        Arg("num_heads", "i32", grid_only=True),
    ]


def args_for(cfg) -> list[Arg]:
    """The argument list of any kernel config."""
    if isinstance(cfg, PrepConfig):
        return prep_args(cfg)
    if isinstance(cfg, CombineConfig):
        return combine_args(cfg)
    return recur_args(cfg)


# ------------------------------------------------------------------------------------ packing
@dataclass
class _Struct:
    buf: bytearray = field(default_factory=bytearray)
    align: int = 1

    def put(self, fmt: str, value) -> None:
        size = struct.calcsize(fmt)
        self.buf += b"\0" * (-len(self.buf) % size)
        self.buf += struct.pack("<" + fmt, value)
        self.align = max(self.align, size)

    def bytes(self, min_align: int = 1) -> bytes:
        a = max(self.align, min_align)
        return bytes(self.buf + b"\0" * (-len(self.buf) % a))


def _fmt(sym: str) -> str:
    return "q" if SYM_WIDTH[sym] == 64 else "i"


def pack_dynamic(entries, syms: dict) -> bytes:
    """The coordinate tensor of a TMA argument: its dynamic shape entries."""
    s = _Struct()
    for e in entries:
        if isinstance(e, str):
            s.put(_fmt(e), syms[e])
    return s.bytes()


def pack_tensor(arg: Arg, ptr: int, syms: dict) -> bytes:
    s = _Struct()
    s.put("Q", ptr)
    for e in arg.shape + arg.stride:
        if isinstance(e, str):
            s.put(_fmt(e), syms[e])
    return s.bytes(8)


def param_sizes(args: list[Arg]) -> list[int]:
    """Sizes of the kernel parameters the list produces, in order (all syms set to 0)."""
    zeros = dict.fromkeys(SYM_WIDTH, 0)
    sizes = []
    for a in args:
        if a.grid_only:
            continue
        if a.kind == "tma":
            sizes += [128, len(pack_dynamic(a.shape, zeros))]
        elif a.kind == "tensor":
            sizes.append(len(pack_tensor(a, 0, zeros)))
        elif a.kind == "mma":
            sizes.append(1)
        else:
            sizes.append(4)
    # a TMA coordinate tensor without dynamic entries produces no parameter
    return [s for s in sizes if s]


def pack_scalar(arg: Arg, value) -> bytes:
    return struct.pack("<i" if arg.kind == "i32" else "<f", value)
