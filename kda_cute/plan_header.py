"""What kda_cute_plan.h holds (the buffers a runtime provides and the operations of one forward,
as records) and how it is written as C text (`header`). kda_cute.plan_export makes the records
from a forward's plan."""

from __future__ import annotations

from dataclasses import dataclass

from .abi import c_ident
from .plans.workspace import ALIGN
from .specs.step import ERRORS

BUFFER_KINDS = ("input", "output", "workspace", "errors", "constant", "scratch")


TMA_DTYPES = {"bfloat16": "KDA_TMA_BFLOAT16", "float16": "KDA_TMA_FLOAT16",
              "float32": "KDA_TMA_FLOAT32"}


MAX_RANK = 5  # the buffer table's shape arrays


class PlanExportError(Exception):
    """The forward does something kda_cute_plan.h cannot express."""


@dataclass(frozen=True)
class PlanBuffer:
    """A device buffer the runtime provides. kind: "input" (the caller fills it), "output"
    (the forward writes it), "workspace" (any contents; its base aligned to ALIGN),
    "errors" (zeros before the forward; a word set after it names a bad value: ERRORS),
    "constant" (`contents`, uploaded once), "scratch" (any contents, written and read within
    the forward). shape and stride in elements."""

    name: str
    kind: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int
    contents: bytes | None = None


@dataclass(frozen=True)
class Address:
    """`offset` bytes into buffer `buffer` (an index into ExportedPlan.buffers)."""

    buffer: int
    offset: int


@dataclass(frozen=True)
class Tma:
    """A CUtensorMap to encode (launch.driver.encode_tiled's arguments, rank 2): dims and box
    innermost first, in elements; the row stride in bytes; the smem swizzle span in bytes."""

    at: Address
    dtype: str
    dims: tuple[int, int]
    row_stride_bytes: int
    box: tuple[int, int]
    swizzle: int


@dataclass(frozen=True)
class Param:
    """One kernel parameter (abi.params' order and roles): `literal` bytes (its size), with the
    first 8 replaced by the address of `address` where given; or the descriptor `tma`."""

    arg: str
    role: str
    size: int
    literal: bytes = b""
    address: Address | None = None
    tma: Tma | None = None


@dataclass(frozen=True)
class MemsetOp:
    """cuMemsetD32Async: `count` 32-bit words at `at` set to `value`."""

    name: str
    at: Address
    value: int
    count: int


@dataclass(frozen=True)
class LaunchOp:
    """A kernel launch: the cubin `kernel` (a name of kda_cute_kernels.h), its grid and block,
    the dynamic shared memory to launch with (and to allow the function first), whether it is
    the programmatic dependent of the stream's previous kernel, and each parameter's recipe."""

    name: str
    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    programmatic: bool
    params: tuple[Param, ...]


@dataclass(frozen=True)
class ExportedPlan:
    """One forward as a runtime replays it: its sizes and options, the schedule, the buffers
    and the operations in order (`header()` is the C text)."""

    problem: dict
    describe: str
    workspace_bytes: int
    buffers: tuple[PlanBuffer, ...]
    ops: tuple[MemsetOp | LaunchOp, ...]

    def buffer(self, name: str) -> PlanBuffer:
        (b,) = [b for b in self.buffers if b.name == name]
        return b

    def header(self) -> str:
        return header(self)


def _bytes_array(name: str, data: bytes) -> list[str]:
    body = [", ".join(f"0x{b:02x}" for b in data[i:i + 16]) for i in range(0, len(data), 16)]
    return [f"static const unsigned char {name}[{len(data)}] = {{"] + [
        f"  {line}," for line in body] + ["};"]


def _c_str(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _dims(xs, n: int) -> str:
    xs = list(xs) + [0] * (n - len(xs))
    return "{" + ", ".join(f"{x}ULL" for x in xs) + "}"


def header(plan: ExportedPlan) -> str:
    """The C text of `plan`: kda_cute_plan.h."""
    pr = plan.problem
    kinds = {k: "KDA_BUFFER_" + k.upper() for k in BUFFER_KINDS}
    out = ["/* kda-cute forward plan: written by kda_cute.plan_export for one problem; replay "
           "its ops",
           "   in order on one stream (examples/cpp/kda_forward.cpp). What the launcher runs:",
           ""] + [f"   {line}" for line in plan.describe.replace("*/", "* /").splitlines()] + [
           f"   gate {pr['gate']}, qk_l2norm {pr['qk_l2norm']}, beta_sigmoid "
           f"{pr['beta_sigmoid']}, wy {pr['wy']},",
           f"   scale {pr['scale']!r} and lower_bound {pr['lower_bound']!r} baked into the "
           f"parameters */", _PRELUDE]
    out += [f"#define KDA_PLAN_{n} {pr[n]}" for n in ("B", "T", "H", "K", "V", "N")]
    out += [f"#define KDA_PLAN_SCALE {float(pr['scale'])!r}",
            f"#define KDA_PLAN_LOWER_BOUND {float(pr['lower_bound'])!r}",
            f"#define KDA_PLAN_WORKSPACE_BYTES {plan.workspace_bytes}ULL",
            f"#define KDA_PLAN_WORKSPACE_ALIGN {ALIGN}",
            f"#define KDA_PLAN_NUM_BUFFERS {len(plan.buffers)}",
            f"#define KDA_PLAN_NUM_OPS {len(plan.ops)}",
            f"#define KDA_PLAN_NUM_ERROR_WORDS {len(ERRORS)}", ""]
    out += [f"#define KDA_PLAN_BUFFER_{b.name} {i}" for i, b in enumerate(plan.buffers)] + [""]

    out.append("/* what a set error word means (kda_cute.specs.step.ERRORS) */")
    out.append("static const char *const kda_plan_error_words[] = {")
    out += [f"  {_c_str(e)}," for e in ERRORS] + ["};", ""]

    for b in plan.buffers:
        if b.contents is not None:
            out += _bytes_array(f"kda_plan_contents_{b.name}", b.contents)
    out.append("static const kda_plan_buffer kda_plan_buffers[] = {")
    for b in plan.buffers:
        contents = f"kda_plan_contents_{b.name}" if b.contents is not None else "NULL"
        out.append(f"  /* {b.name}: {b.dtype} {list(b.shape)} */")
        out.append(f"  {{{_c_str(b.name)}, {kinds[b.kind]}, {_c_str(b.dtype)}, {len(b.shape)}, "
                   f"{_dims(b.shape, MAX_RANK)}, {_dims(b.stride, MAX_RANK)}, {b.nbytes}ULL, "
                   f"{contents}}},")
    out += ["};", ""]

    def buf(i: int) -> str:
        return f"KDA_PLAN_BUFFER_{plan.buffers[i].name}"

    rows = []
    for i, op in enumerate(plan.ops):
        if isinstance(op, MemsetOp):
            rows.append(f"  {{KDA_OP_MEMSET_D32, {_c_str(op.name)}, {buf(op.at.buffer)}, "
                        f"{op.at.offset}ULL, {op.value}u, {op.count}ULL, NULL, {{0, 0, 0}}, "
                        f"{{0, 0, 0}}, 0, 0, 0, NULL}},")
            continue
        params = []
        for j, p in enumerate(op.params):
            if p.tma is not None:
                t = p.tma
                params.append(f"  {{KDA_PARAM_TMA, {p.size}, NULL, {buf(t.at.buffer)}, "
                              f"{t.at.offset}ULL, {TMA_DTYPES[t.dtype]}, 2, {_dims(t.dims, 2)}, "
                              f"{t.row_stride_bytes}ULL, {{{t.box[0]}, {t.box[1]}}}, "
                              f"{t.swizzle}}}, /* {p.arg} */")
                continue
            data = f"kda_plan_op{i}_p{j}"
            out += _bytes_array(data, p.literal)
            if p.address is not None:
                params.append(f"  {{KDA_PARAM_ADDRESS, {p.size}, {data}, {buf(p.address.buffer)}, "
                              f"{p.address.offset}ULL, KDA_TMA_BFLOAT16, 0, {{0, 0}}, 0, "
                              f"{{0, 0}}, 0}}, /* {p.arg} */")
            else:
                params.append(f"  {{KDA_PARAM_BYTES, {p.size}, {data}, 0, 0, KDA_TMA_BFLOAT16, "
                              f"0, {{0, 0}}, 0, {{0, 0}}, 0}}, /* {p.arg} ({p.role}) */")
        out.append(f"static const kda_plan_param kda_plan_op{i}_params[] = {{")
        out += params + ["};", ""]
        g, bl = op.grid, op.block
        rows.append(f"  {{KDA_OP_LAUNCH, {_c_str(op.name)}, 0, 0, 0, 0, &{c_ident(op.kernel)}, "
                    f"{{{g[0]}, {g[1]}, {g[2]}}}, {{{bl[0]}, {bl[1]}, {bl[2]}}}, {op.smem}, "
                    f"{int(op.programmatic)}, {len(op.params)}, kda_plan_op{i}_params}},")
    out.append("static const kda_plan_op kda_plan_ops[] = {")
    out += rows + ["};", "", "#endif", ""]
    return "\n".join(out)


# -------------------------------------------------------------------------------- the header
_PRELUDE = r"""#ifndef KDA_CUTE_PLAN_H
#define KDA_CUTE_PLAN_H

#include <stddef.h>

#include "kda_cute_kernels.h"

/* a buffer the runtime provides: INPUT filled by the caller, OUTPUT written by the forward,
   WORKSPACE any contents (its base aligned to KDA_PLAN_WORKSPACE_ALIGN), ERRORS zeros before
   the forward (a word set after it: kda_plan_error_words says which value was bad), CONSTANT
   `contents` uploaded, SCRATCH any contents; every base 16-byte aligned (TMA, and K2's state
   rows in column pairs: cuMemAlloc's bases are) */
typedef enum { KDA_BUFFER_INPUT, KDA_BUFFER_OUTPUT, KDA_BUFFER_WORKSPACE, KDA_BUFFER_ERRORS,
               KDA_BUFFER_CONSTANT, KDA_BUFFER_SCRATCH } kda_buffer_kind;

/* shape and stride in elements, outermost first; bytes: what it spans */
typedef struct {
  const char *name; kda_buffer_kind kind; const char *dtype;
  unsigned rank; unsigned long long shape[5], stride[5], bytes;
  const unsigned char *contents;
} kda_plan_buffer;

/* a kernel parameter: BYTES copied; ADDRESS the bytes with their first 8 replaced by the
   address of `buffer` + `offset`; TMA a CUtensorMap from cuTensorMapEncodeTiled(dtype, rank,
   address of buffer + offset, dims, {row_stride_bytes}, box, element strides {1, 1},
   INTERLEAVE_NONE, swizzle, L2_PROMOTION_L2_128B, FLOAT_OOB_FILL_NONE); dims and box
   innermost first, in elements; swizzle in bytes (0: none) */
typedef enum { KDA_PARAM_BYTES, KDA_PARAM_ADDRESS, KDA_PARAM_TMA } kda_param_recipe;
typedef enum { KDA_TMA_BFLOAT16, KDA_TMA_FLOAT16, KDA_TMA_FLOAT32 } kda_tma_dtype;

typedef struct {
  kda_param_recipe recipe; unsigned size; const unsigned char *bytes;
  unsigned buffer; unsigned long long offset;
  kda_tma_dtype dtype; unsigned rank; unsigned long long dims[2], row_stride_bytes;
  unsigned box[2], swizzle;
} kda_plan_param;

/* MEMSET_D32: `count` 32-bit words at buffer + offset set to `value` (cuMemsetD32Async);
   LAUNCH: `kernel` with grid, block and `smem` bytes of dynamic shared memory (the function
   allowed at least that much first), as the programmatic dependent of the stream's previous
   kernel where `programmatic`; params in the kernel table's order */
typedef enum { KDA_OP_MEMSET_D32, KDA_OP_LAUNCH } kda_plan_op_kind;

typedef struct {
  kda_plan_op_kind kind; const char *name;
  unsigned buffer; unsigned long long offset; unsigned value; unsigned long long count;
  const kda_kernel *kernel; unsigned grid[3], block[3], smem; int programmatic;
  unsigned num_params; const kda_plan_param *params;
} kda_plan_op;
"""
