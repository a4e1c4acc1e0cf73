"""kda_cute.plan_export on a CPU: the plan header of a forward says exactly what the Python
launcher hands the driver (tests/launch_record.py's record of the same problem: every launch's
cubin, grid, block, shared memory, programmatic flag and parameter bytes, every address by the
buffer it points into, every TMA descriptor's arguments, the launcher's own tensors' sizes and
contents), both as the Python plan and as the C header itself, compiled with the system C
compiler into a program that prints it back. Where a C++ compiler and cuda.h are found, the C++
example itself (examples/cpp/kda_forward.cpp), linked with a recording stand-in for libcuda,
runs on the CPU and hands that driver the same launches byte for byte. What the header cannot
express raises."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from kda_cute import abi, checks, cli, plan_export, plan_record
from kda_cute.plan_export import Address, LaunchOp, MemsetOp, PlanExportError
from tests import launch_record

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "cpp" / "kda_forward.cpp"
pytestmark = pytest.mark.skipif(not launch_record.CUBIN_DIR.exists(),
                                reason="cubins not built (`make kernels`)")

# export_plan's arguments: each head dim and precision, WY on and off, gate forms, a state
# left out on either side, prenormed inputs, T not a multiple of the chunk or of 64
CASES = {
    "k128-t1000": dict(B=1, T=1000, H=4, K=128),
    "k64-b2-precise": dict(B=2, T=100, H=2, K=64, precision="precise"),
    "k256-no-initial-state": dict(B=1, T=77, H=2, K=256, initial_state=False),
    "k128-wy-unbounded-h64": dict(B=1, T=200, H=64, K=128, wy="auto", gate="unbounded"),
    "k64-prenormed-no-final-state": dict(B=1, T=50, H=3, K=64, qk_l2norm=False,
                                         beta_sigmoid=False, lower_bound=-1.5,
                                         final_state=False),
    "k128-gate-none-b3": dict(B=3, T=65, H=2, K=128, gate="none"),
}


def _spec(kw: dict) -> dict:
    """launch_record's problem spec of export_plan's arguments (the same defaults: scale
    K ** -0.5, fp32 states, the serial schedule without segments)."""
    spec = {n: kw[n] for n in ("B", "T", "H", "K", "gate", "qk_l2norm", "beta_sigmoid",
                               "precision", "lower_bound") if n in kw}
    spec.update(segments=1, alongside=False, wy=kw.get("wy", "off"),
                state_in="f32" if kw.get("initial_state", True) else None,
                state_out="f32" if kw.get("final_state", True) else None)
    return spec


# ------------------------------------------------------------------------- a common form
# ops as ("memset", buffer, offset, value, count) or ("launch", name, kernel, grid, block, smem,
# programmatic, params), each param ("bytes", hex) / ("address", buffer, offset, hex) /
# ("tma", buffer, offset, dtype, rank, dims, row stride, box, swizzle); buffers as
# (name, kind, bytes, contents hex or None): what the Python plan and the C header both give
def _from_plan(plan) -> tuple[list, list]:
    def name(a: Address) -> str:
        return plan.buffers[a.buffer].name

    ops = []
    for op in plan.ops:
        if isinstance(op, MemsetOp):
            ops.append(("memset", name(op.at), op.at.offset, op.value, op.count))
            continue
        params = []
        for p in op.params:
            if p.tma is not None:
                t = p.tma
                params.append(("tma", name(t.at), t.at.offset, t.dtype, 2, tuple(t.dims),
                               t.row_stride_bytes, tuple(t.box), t.swizzle))
            elif p.address is not None:
                params.append(("address", name(p.address), p.address.offset, p.literal.hex()))
            else:
                params.append(("bytes", p.literal.hex()))
        ops.append(("launch", op.name, op.kernel, tuple(op.grid), tuple(op.block), op.smem,
                    op.programmatic, params))
    bufs = [(b.name, b.kind, b.nbytes, None if b.contents is None else b.contents.hex())
            for b in plan.buffers]
    return ops, bufs


DUMPER = r"""
#include <stdio.h>
#include <string.h>
#include "kda_cute_plan.h"

static const char *kinds[] = {"input", "output", "workspace", "errors", "constant", "scratch"};
static const char *dtypes[] = {"bfloat16", "float16", "float32"};

static void hex(const unsigned char *p, unsigned long long n) {
  unsigned long long i;
  for (i = 0; i < n; ++i) printf("%02x", p[i]);
}

int main(void) {
  unsigned i, j;
  for (i = 0; i < KDA_PLAN_NUM_BUFFERS; ++i) {
    const kda_plan_buffer *b = &kda_plan_buffers[i];
    printf("buffer %s %s %llu ", b->name, kinds[b->kind], b->bytes);
    if (b->contents) hex(b->contents, b->bytes); else printf("-");
    printf("\n");
  }
  for (i = 0; i < KDA_PLAN_NUM_OPS; ++i) {
    const kda_plan_op *op = &kda_plan_ops[i];
    if (op->kind == KDA_OP_MEMSET_D32) {
      printf("memset %s %llu %u %llu\n", kda_plan_buffers[op->buffer].name, op->offset,
             op->value, op->count);
      continue;
    }
    printf("launch %s|%s %u %u %u %u %u %u %u %d %u\n", op->name, op->kernel->name,
           op->grid[0], op->grid[1], op->grid[2], op->block[0], op->block[1], op->block[2],
           op->smem, op->programmatic, op->num_params);
    if (op->num_params != op->kernel->num_params) printf("mismatch: params\n");
    for (j = 0; j < op->num_params; ++j) {
      const kda_plan_param *p = &op->params[j];
      if (p->size != op->kernel->params[j].size) printf("mismatch: param %u\n", j);
      if (p->recipe == KDA_PARAM_TMA) {
        printf("tma %s %llu %s %u %llu %llu %llu %u %u %u\n", kda_plan_buffers[p->buffer].name,
               p->offset, dtypes[p->dtype], p->rank, p->dims[0], p->dims[1],
               p->row_stride_bytes, p->box[0], p->box[1], p->swizzle);
      } else if (p->recipe == KDA_PARAM_ADDRESS) {
        printf("address %s %llu ", kda_plan_buffers[p->buffer].name, p->offset);
        hex(p->bytes, p->size);
        printf("\n");
      } else {
        printf("bytes ");
        hex(p->bytes, p->size);
        printf("\n");
      }
    }
  }
  return 0;
}
"""


def _from_dump(text: str) -> tuple[list, list]:
    ops, bufs = [], []
    for line in text.splitlines():
        w = line.split(" ")
        assert not line.startswith("mismatch"), line
        if w[0] == "buffer":
            bufs.append((w[1], w[2], int(w[3]), None if w[4] == "-" else w[4]))
        elif w[0] == "memset":
            ops.append(("memset", w[1], int(w[2]), int(w[3]), int(w[4])))
        elif w[0] == "launch":
            head, rest = line[len("launch "):].split("|")
            r = rest.split(" ")
            n = list(map(int, r[1:]))
            ops.append(("launch", head, r[0], tuple(n[0:3]), tuple(n[3:6]), n[6], bool(n[7]),
                        []))
        elif w[0] == "tma":
            n = list(map(int, w[4:]))
            ops[-1][-1].append(("tma", w[1], int(w[2]), w[3], n[0], tuple(n[1:3]), n[3],
                                tuple(n[4:6]), n[6]))
        elif w[0] == "address":
            ops[-1][-1].append(("address", w[1], int(w[2]), w[3]))
        else:
            ops[-1][-1].append(("bytes", w[1]))
    return ops, bufs


def _as_record(ops: list, bufs: list) -> tuple[list, dict]:
    """The common form as launch_record normalises a run: the call's tensors by role, the
    launcher's own as anon0, anon1, ... in order of first use, their sizes and contents (hex up
    to 64 bytes, else a digest)."""
    table = {name: (kind, nbytes, contents) for name, kind, nbytes, contents in bufs}
    anon: dict[str, str] = {}

    def label(name: str, offset: int) -> str:
        if table[name][0] in ("constant", "scratch"):
            name = anon.setdefault(name, f"anon{len(anon)}")
        return f"@{name}+{offset}"

    def words(data: str) -> str:
        if len(data) % 16:
            return data
        return " ".join(data[i:i + 16] for i in range(0, len(data), 16))

    rec = []
    for op in ops:
        if op[0] == "memset":
            _, name, offset, value, count = op
            rec.append({"op": "memset_d32", "ptr": label(name, offset), "value": value,
                        "count": count})
            continue
        _, _, kernel, grid, block, smem, programmatic, params = op
        blobs = []
        for p in params:
            if p[0] == "tma":
                _, name, offset, dtype, rank, dims, stride, box, swizzle = p
                blobs.append("tma" + json.dumps(
                    {"box": list(box), "dims": list(dims), "dtype": dtype,
                     "ptr": label(name, offset), "rank": rank, "row_stride_bytes": [stride],
                     "swizzle": swizzle}, sort_keys=True))
            elif p[0] == "address":
                _, name, offset, data = p
                rest = words(data[16:])
                blobs.append(label(name, offset) + (" " + rest if rest else ""))
            else:
                blobs.append(words(p[1]))
        rec.append({"op": "launch", "kernel": kernel, "grid": list(grid), "block": list(block),
                    "smem": smem, "programmatic": programmatic, "params": blobs})
    contents = {}
    for name, label_ in anon.items():
        data = table[name][2]
        digest = (None if data is None else data if len(data) <= 128
                  else "sha256:" + hashlib.sha256(bytes.fromhex(data)).hexdigest()[:32])
        contents[label_] = {"bytes": table[name][1], "contents": digest}
    return rec, contents


def _recorded(name: str, kw: dict, monkeypatch) -> tuple[list, dict]:
    """launch_record's record of the same problem, without the stream (the plan has one)."""
    monkeypatch.setitem(launch_record.PROBLEMS, f"plan-export-{name}", _spec(kw))
    rec = launch_record.record(f"plan-export-{name}", monkeypatch)
    assert rec["schedule"] == "serial"
    ops = [{k: v for k, v in op.items() if k != "stream"} for op in rec["ops"]]
    return ops, rec["anon"]


def _compare(got: tuple[list, dict], want: tuple[list, dict]) -> None:
    assert len(got[0]) == len(want[0]), [o.get("kernel", o["op"]) for o in want[0]]
    for i, (g, w) in enumerate(zip(got[0], want[0], strict=True)):
        assert g == w, f"op {i} ({w.get('kernel', w['op'])})"
    assert got[1] == want[1]


# ----------------------------------------------------------------------------- compilers
def _compiler(*names: str) -> str | None:
    return next((p for p in map(shutil.which, names) if p), None)


def _cuda_include() -> Path | None:
    """A folder with cuda.h: the toolkit's, or a pip package's (nvidia-cuda-runtime, triton)."""
    site = Path(torch.__file__).resolve().parent.parent
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    found = [Path(r) / "include" for r in roots if r]
    found += sorted(site.glob("nvidia/*/include")) + [site / "triton/backends/nvidia/include"]
    return next((d for d in found if (d / "cuda.h").exists()), None)


@pytest.fixture(scope="module")
def kernels_dir(tmp_path_factory) -> Path:
    """`kda-cute export --ops prefill`'s folder: the cubins and kda_cute_kernels.h."""
    out = tmp_path_factory.mktemp("export")
    cli.export(str(out), "sm_90a", "prefill", False)
    return out


# --------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(CASES))
def test_plan_is_what_the_launcher_launches(name, monkeypatch):
    """The recorded plan's ops, buffers and parameter recipes, rendered as launch_record
    renders a run, equal its record of the same problem op for op and byte for byte."""
    kw = CASES[name]
    plan = plan_export.record_plan(**kw)
    assert plan.problem["schedule"] == "serial"
    want = _recorded(name, kw, monkeypatch)
    _compare(_as_record(*_from_plan(plan)), want)
    # the call's tensors: by role, with their layouts (contiguous, the dtypes fwd takes)
    K, V, H, B, T = kw["K"], kw["K"], kw["H"], kw["B"], kw["T"]
    shapes = {"q": (B, T, H, K), "beta": (B, T, H), "out": (B, T, H, V), "A_log": (H,),
              "dt_bias": (H, K), "initial_state": (B, H, V, K), "final_state": (B, H, V, K)}
    for role, shape in shapes.items():
        if not kw.get(role, True):
            assert role not in [b.name for b in plan.buffers]
            continue
        b = plan.buffer(role)
        assert b.shape == shape and b.kind == plan_export.ROLES[role]
        size = 2 if b.dtype == "bfloat16" else 4
        assert b.nbytes == size * torch.Size(shape).numel()
        assert b.stride == torch.empty(shape).stride()
    assert plan.buffer("workspace").nbytes == plan.workspace_bytes


@pytest.mark.parametrize("name", ["k128-t1000", "k64-b2-precise", "k256-no-initial-state"])
def test_header_compiles_and_says_the_same(name, tmp_path, kernels_dir, monkeypatch):
    """kda_cute_plan.h with kda_cute_kernels.h compiles as C99 and C++17 without warnings, and a
    program built from it prints back the launcher's record: the header itself, not only the
    Python plan, is what the launcher launches."""
    cc = _compiler("cc", "gcc", "clang")
    if cc is None:
        pytest.skip("no C compiler")
    kw = CASES[name]
    plan = plan_export.export_plan(tmp_path, **kw)
    shutil.copy(kernels_dir / cli.HEADER, tmp_path / cli.HEADER)
    (tmp_path / "dump.c").write_text(DUMPER)
    exe = tmp_path / "dump"
    subprocess.run([cc, "-std=c99", "-Wall", "-Wextra", "-Werror", "-I", str(tmp_path),
                    str(tmp_path / "dump.c"), "-o", str(exe)], check=True)
    text = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    dumped = _from_dump(text)
    assert dumped == _from_plan(plan)
    _compare(_as_record(*dumped), _recorded(name, kw, monkeypatch))
    cxx = _compiler("c++", "g++", "clang++")
    if cxx is not None:
        (tmp_path / "dump.cpp").write_text(DUMPER)
        subprocess.run([cxx, "-std=c++17", "-Wall", "-Wextra", "-Werror", "-I", str(tmp_path),
                        "-c", str(tmp_path / "dump.cpp"), "-o", str(tmp_path / "dump.o")],
                       check=True)


# a stand-in for the parts of libcuda kda_forward.cpp calls: device memory is host memory, and
# every allocation, memset, descriptor and launch (each parameter's bytes, by the kernel
# table's sizes) is written to $KDA_FAKE_CUDA_LOG
FAKE_CUDA = r"""
#include <cuda.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kda_cute_kernels.h"

static FILE *out() {
  static FILE *f = std::fopen(std::getenv("KDA_FAKE_CUDA_LOG"), "w");
  return f;
}
static void hex(const void *p, unsigned n) {
  for (unsigned i = 0; i < n; ++i) std::fprintf(out(), "%02x", ((const unsigned char *)p)[i]);
}
static unsigned long long maps = 0;
static int allowed[KDA_CUTE_NUM_KERNELS];

static CUresult launch(CUfunction f, const unsigned *grid, const unsigned *block,
                       unsigned smem, int programmatic, void **params, void **extra) {
  const kda_kernel *k = kda_cute_kernels[(size_t)f - 1];
  if (extra || (int)smem > allowed[(size_t)f - 1]) return CUDA_ERROR_INVALID_VALUE;
  std::fprintf(out(), "launch %s %u %u %u %u %u %u %u %d\n", k->name, grid[0], grid[1],
               grid[2], block[0], block[1], block[2], smem, programmatic);
  for (unsigned i = 0; i < k->num_params; ++i) {
    std::fprintf(out(), "param ");
    hex(params[i], k->params[i].size);
    std::fprintf(out(), "\n");
  }
  return CUDA_SUCCESS;
}

extern "C" {
CUresult CUDAAPI cuInit(unsigned int) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGet(CUdevice *d, int) { *d = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetAttribute(int *v, CUdevice_attribute a, CUdevice) {
  *v = a == CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR ? 9 : 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *c, CUdevice) {
  *c = (CUcontext)1;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuDevicePrimaryCtxRelease(CUdevice) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSynchronize(void) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuStreamCreate(CUstream *s, unsigned int) {
  *s = (CUstream)2;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamSynchronize(CUstream) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuStreamDestroy(CUstream) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuMemAlloc(CUdeviceptr *p, size_t n) {
  void *m = std::aligned_alloc(256, (n + 255) / 256 * 256);
  *p = (CUdeviceptr)m;
  std::fprintf(out(), "alloc %llu %zu\n", (unsigned long long)*p, n);
  return m ? CUDA_SUCCESS : CUDA_ERROR_OUT_OF_MEMORY;
}
CUresult CUDAAPI cuMemFree(CUdeviceptr p) {
  std::free((void *)p);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyHtoD(CUdeviceptr d, const void *s, size_t n) {
  std::memcpy((void *)d, s, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemcpyDtoH(void *d, CUdeviceptr s, size_t n) {
  std::memcpy(d, (const void *)s, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD8(CUdeviceptr d, unsigned char v, size_t n) {
  std::memset((void *)d, v, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuMemsetD32Async(CUdeviceptr d, unsigned int v, size_t n, CUstream) {
  std::fprintf(out(), "memset %llu %u %zu\n", (unsigned long long)d, v, n);
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleLoadData(CUmodule *m, const void *image) {
  // which kernel's cubin: the one in $KDA_FAKE_CUBIN_DIR with these bytes (entry names are
  // not unique across cubins)
  const unsigned char *h = (const unsigned char *)image;
  unsigned long long phoff, shoff;
  unsigned short phentsize, phnum, shentsize, shnum;
  if (std::memcmp(h, "\x7f" "ELF", 4)) return CUDA_ERROR_INVALID_IMAGE;
  std::memcpy(&phoff, h + 0x20, 8);
  std::memcpy(&shoff, h + 0x28, 8);
  std::memcpy(&phentsize, h + 0x36, 2);
  std::memcpy(&phnum, h + 0x38, 2);
  std::memcpy(&shentsize, h + 0x3a, 2);
  std::memcpy(&shnum, h + 0x3c, 2);
  unsigned long long a = phoff + phentsize * phnum, b = shoff + shentsize * shnum;
  unsigned long long size = a > b ? a : b;
  for (size_t i = 0; i < KDA_CUTE_NUM_KERNELS; ++i) {
    char path[4096];
    std::snprintf(path, sizeof path, "%s/%s.cubin", std::getenv("KDA_FAKE_CUBIN_DIR"),
                  kda_cute_kernels[i]->name);
    FILE *f = std::fopen(path, "rb");
    if (!f) continue;
    static unsigned char data[1 << 24];
    size_t n = std::fread(data, 1, sizeof data, f);
    std::fclose(f);
    if (n == size && !std::memcmp(data, image, n)) {
      *m = (CUmodule)(i + 1);
      return CUDA_SUCCESS;
    }
  }
  return CUDA_ERROR_INVALID_IMAGE;
}
CUresult CUDAAPI cuModuleUnload(CUmodule) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuModuleGetFunction(CUfunction *f, CUmodule m, const char *entry) {
  if (std::strcmp(kda_cute_kernels[(size_t)m - 1]->entry, entry)) return CUDA_ERROR_NOT_FOUND;
  *f = (CUfunction)m;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction f, CUfunction_attribute a, int v) {
  if (a != CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) return CUDA_ERROR_INVALID_VALUE;
  allowed[(size_t)f - 1] = v;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap *m, CUtensorMapDataType dt, cuuint32_t rank,
                                        void *addr, const cuuint64_t *dims,
                                        const cuuint64_t *strides, const cuuint32_t *box,
                                        const cuuint32_t *elem, CUtensorMapInterleave il,
                                        CUtensorMapSwizzle sw, CUtensorMapL2promotion l2,
                                        CUtensorMapFloatOOBfill oob) {
  const char *dtype = dt == CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 ? "bfloat16"
                      : dt == CU_TENSOR_MAP_DATA_TYPE_FLOAT16 ? "float16"
                      : dt == CU_TENSOR_MAP_DATA_TYPE_FLOAT32 ? "float32" : "?";
  unsigned swizzle = sw == CU_TENSOR_MAP_SWIZZLE_NONE ? 0 : sw == CU_TENSOR_MAP_SWIZZLE_32B ? 32
                     : sw == CU_TENSOR_MAP_SWIZZLE_64B ? 64 : sw == CU_TENSOR_MAP_SWIZZLE_128B ? 128
                     : 1;
  if (rank != 2 || elem[0] != 1 || elem[1] != 1 || il != CU_TENSOR_MAP_INTERLEAVE_NONE ||
      l2 != CU_TENSOR_MAP_L2_PROMOTION_L2_128B || oob != CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    return CUDA_ERROR_INVALID_VALUE;
  std::fprintf(out(), "tma %llu %s %u %llu %llu %llu %llu %u %u %u\n", maps, dtype, rank,
               (unsigned long long)addr, (unsigned long long)dims[0],
               (unsigned long long)dims[1], (unsigned long long)strides[0], box[0], box[1],
               swizzle);
  std::memset(m, 0, sizeof *m);
  std::memcpy(m, "FAKETMAP", 8);
  std::memcpy((char *)m + 8, &maps, 8);
  ++maps;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz,
                                unsigned bx, unsigned by, unsigned bz, unsigned smem,
                                CUstream, void **params, void **extra) {
  unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
  return launch(f, grid, block, smem, 0, params, extra);
}
CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params,
                                  void **extra) {
  unsigned grid[3] = {c->gridDimX, c->gridDimY, c->gridDimZ};
  unsigned block[3] = {c->blockDimX, c->blockDimY, c->blockDimZ};
  int prog = c->numAttrs == 1 &&
             c->attrs[0].id == CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION &&
             c->attrs[0].value.programmaticStreamSerializationAllowed == 1;
  if (c->numAttrs != (unsigned)prog) return CUDA_ERROR_INVALID_VALUE;
  return launch(f, grid, block, c->sharedMemBytes, prog, params, extra);
}
CUresult CUDAAPI cuGetErrorName(CUresult, const char **s) {
  *s = "fake";
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGetErrorString(CUresult, const char **s) {
  *s = "fake";
  return CUDA_SUCCESS;
}
}
"""


def _from_fake_log(text: str, plan) -> tuple[list, dict]:
    """The fake driver's log as launch_record normalises a run: each address by the plan buffer
    it points into (the example allocates them in the plan's order), the launcher's own as
    anon0, anon1, ... in order of first use."""
    lines = [line.split(" ") for line in text.splitlines()]
    allocs = [(int(w[1]), int(w[2])) for w in lines if w[0] == "alloc"]
    assert len(allocs) == len(plan.buffers)
    spans = []
    for (ptr, _), b in zip(allocs, plan.buffers, strict=True):
        base = ptr + (-ptr) % plan_export.ALIGN if b.kind == "workspace" else ptr
        spans.append((b, base))
    anon: dict[str, str] = {}

    def label(p: int) -> str | None:
        for b, base in spans:
            if base <= p < base + max(b.nbytes, 1):
                name = b.name
                if b.kind in ("constant", "scratch"):
                    name = anon.setdefault(b.name, f"anon{len(anon)}")
                return f"@{name}+{p - base}"
        return None

    maps, ops = {}, []
    for w in lines:
        if w[0] == "tma":
            n = list(map(int, w[3:]))
            maps[int(w[1])] = {"dtype": w[2], "rank": n[0], "ptr": n[1], "dims": n[2:4],
                               "row_stride_bytes": [n[4]], "box": n[5:7], "swizzle": n[7]}
        elif w[0] == "memset":
            ops.append({"op": "memset_d32", "ptr": label(int(w[1])), "value": int(w[2]),
                        "count": int(w[3])})
        elif w[0] == "launch":
            n = list(map(int, w[2:]))
            ops.append({"op": "launch", "kernel": w[1], "grid": n[0:3], "block": n[3:6],
                        "smem": n[6], "programmatic": bool(n[7]), "params": []})
        elif w[0] == "param":
            blob = bytes.fromhex(w[1])
            if len(blob) == 128 and blob[:8] == b"FAKETMAP":
                m = dict(maps[int.from_bytes(blob[8:16], "little")])
                m["ptr"] = label(m["ptr"])
                text_ = "tma" + json.dumps(m, sort_keys=True)
            elif len(blob) % 8:
                text_ = blob.hex()
            else:
                text_ = " ".join(label(int.from_bytes(blob[i:i + 8], "little"))
                                 or blob[i:i + 8].hex() for i in range(0, len(blob), 8))
            ops[-1]["params"].append(text_)
    contents = {}
    for name, label_ in anon.items():
        data = plan.buffer(name).contents
        digest = (None if data is None else data.hex() if len(data) <= 64
                  else "sha256:" + hashlib.sha256(data).hexdigest()[:32])
        contents[label_] = {"bytes": plan.buffer(name).nbytes, "contents": digest}
    return ops, contents


@pytest.mark.parametrize("name", ["k128-t1000", "k64-b2-precise", "k128-gate-none-b3"])
def test_cpp_example_hands_the_driver_what_the_launcher_does(name, tmp_path, kernels_dir,
                                                            monkeypatch):
    """examples/cpp/kda_forward.cpp, built against the plan and linked with a recording
    stand-in for libcuda (cuda.h needed), runs on the CPU: what it hands the driver
    (allocations, memsets, descriptors, launches with every parameter's bytes) is the launcher's
    record of the same problem, and it writes each output (poisoned: nothing ran)."""
    cxx = _compiler("c++", "g++", "clang++")
    inc = _cuda_include()
    if cxx is None or inc is None:
        pytest.skip("no C++ compiler" if cxx is None else "no cuda.h")
    kw = CASES[name]
    plan = plan_export.export_plan(tmp_path, **kw)
    shutil.copy(kernels_dir / cli.HEADER, tmp_path / cli.HEADER)
    (tmp_path / "fake_cuda.cpp").write_text(FAKE_CUDA)
    exe = tmp_path / "kda_forward"
    subprocess.run([cxx, "-std=c++17", "-O2", "-Wall", "-Wextra", "-Werror", "-I", str(inc),
                    "-I", str(tmp_path), str(EXAMPLE), str(tmp_path / "fake_cuda.cpp"), "-o",
                    str(exe)], check=True)
    ins, outs = tmp_path / "in", tmp_path / "out"
    ins.mkdir()
    outs.mkdir()
    for b in plan.buffers:
        if b.kind == "input":
            (ins / f"{b.name}.bin").write_bytes(bytes(range(256)) * (b.nbytes // 256)
                                                + bytes(b.nbytes % 256))
    log = tmp_path / "driver.log"
    env = dict(os.environ, KDA_FAKE_CUDA_LOG=str(log), KDA_FAKE_CUBIN_DIR=str(kernels_dir))
    res = subprocess.run([str(exe), str(kernels_dir), str(ins), str(outs)], env=env,
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    _compare(_from_fake_log(log.read_text(), plan), _recorded(name, kw, monkeypatch))
    for b in plan.buffers:
        if b.kind == "output":
            assert (outs / f"{b.name}.bin").read_bytes() == b"\xff" * b.nbytes
    # a short input: a message naming the file, a non-zero status
    (ins / "beta.bin").write_bytes(bytes(10))
    res = subprocess.run([str(exe), str(kernels_dir), str(ins), str(outs)], env=env,
                         capture_output=True, text=True)
    assert res.returncode != 0 and "beta.bin: expected" in res.stderr, res.stderr


def test_plan_kernels_are_in_the_export(kernels_dir):
    """Every kernel a plan launches is one `kda-cute export --ops prefill` writes (its cubin and
    its table in kda_cute_kernels.h)."""
    text = (kernels_dir / cli.HEADER).read_text()
    for kw in CASES.values():
        for op in plan_export.record_plan(**kw).ops:
            if isinstance(op, LaunchOp):
                assert (kernels_dir / f"{op.kernel}.cubin").exists()
                assert f"static const kda_kernel {abi.c_ident(op.kernel)} = {{" in text


def test_command_line(tmp_path, capsys):
    argv = ["--out", str(tmp_path), "--B", "1", "--T", "300", "--H", "2", "--K", "64"]
    assert plan_export.main(argv) == 0
    assert "#define KDA_PLAN_T 300" in (tmp_path / plan_export.HEADER).read_text()
    assert plan_export.main(argv[:-1] + ["96"]) == 2
    assert "plan_export:" in capsys.readouterr().err


@pytest.mark.parametrize("kw, exc, words", [
    (dict(T=0), ValueError, "T: expected an int >= 1, got 0"),
    (dict(H=2.0), ValueError, "H: expected an int"),
    (dict(K=96), ValueError, "head dims"),
    (dict(wy="sometimes"), ValueError, "wy"),
    (dict(precision="exact"), ValueError, "precision"),
    (dict(initial_state="yes"), TypeError, "initial_state: expected a bool"),
    (dict(lower_bound=1.0), ValueError, "lower_bound"),
])
def test_bad_arguments(kw, exc, words):
    args = dict(B=1, T=64, H=2, K=128)
    args.update(kw)
    with pytest.raises(exc, match=words):
        plan_export.record_plan(**args)


def test_what_it_cannot_express_raises():
    """The alongside schedule (two streams ordered by events), an event asked of the driver, an
    address in no buffer: each a PlanExportError naming it."""
    call = plan_export._call(1, 1000, 4, 128, 128, True, True, 128 ** -0.5, -5.0)
    opts = checks.options(segments=1, alongside=True)
    with pytest.raises(PlanExportError, match="alongside"):
        plan_export._record(call, opts, {})
    with pytest.raises(PlanExportError, match="events"):
        plan_record._Recorder({}).cuEventCreate(0)
    spans = plan_export._Spans()
    spans.add(0, torch.empty(16, dtype=torch.uint8))
    with pytest.raises(PlanExportError, match="in none of the plan's buffers"):
        spans(spans.spans[0][1] + 16, "a parameter")  # one past its end

