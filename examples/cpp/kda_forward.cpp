// kda_forward: one KDA forward on a Hopper GPU through the CUDA driver API alone, as
// kda_cute_plan.h describes it (written by kda_cute.plan_export), with the cubins and the
// kernel tables of `kda-cute export` (kda_cute_kernels.h). No Python, torch or runtime API.
//
//   kda_forward CUBIN_DIR IN_DIR OUT_DIR
//
// reads each input buffer of the plan (q, k, v, g, beta, A_log, dt_bias, initial_state) from
// IN_DIR/<name>.bin, raw little-endian bytes in the plan's layout (contiguous, the plan's
// dtype), runs the plan's operations in order on one stream and writes each output buffer (out,
// final_state) to OUT_DIR/<name>.bin. Every driver call is checked: a failure, a missing or
// short file, a plan that disagrees with the kernel tables, or an error word the kernels set
// ends the program with a message and a non-zero status.
//
// It launches what kda_cute.launch would: the same parameter bytes (packed at the kernel
// table's offsets, passed as kernelParams), TMA descriptors encoded with the same arguments as
// kda_cute.launch.driver.encode_tiled, each function allowed the dynamic shared memory it is
// launched with, programmatic launches through cuLaunchKernelEx.

#include <cuda.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kda_cute_kernels.h"
#include "kda_cute_plan.h"

namespace {

[[noreturn]] void fail(const std::string &msg) {
  std::fprintf(stderr, "kda_forward: %s\n", msg.c_str());
  std::exit(1);
}

void check(CUresult r, const char *call, int line) {
  if (r == CUDA_SUCCESS) return;
  const char *name = nullptr, *text = nullptr;
  cuGetErrorName(r, &name);
  cuGetErrorString(r, &text);
  fail(std::string(call) + " (line " + std::to_string(line) + "): " + (name ? name : "?") +
       ": " + (text ? text : ""));
}

#define CU(call) check((call), #call, __LINE__)

std::vector<unsigned char> read_file(const std::string &path) {
  FILE *f = std::fopen(path.c_str(), "rb");
  if (!f) fail("cannot open " + path);
  std::vector<unsigned char> data;
  unsigned char chunk[1 << 16];
  size_t n;
  while ((n = std::fread(chunk, 1, sizeof chunk, f)) > 0) data.insert(data.end(), chunk, chunk + n);
  bool bad = std::ferror(f);
  std::fclose(f);
  if (bad) fail("cannot read " + path);
  return data;
}

void write_file(const std::string &path, const std::vector<unsigned char> &data) {
  FILE *f = std::fopen(path.c_str(), "wb");
  if (!f || std::fwrite(data.data(), 1, data.size(), f) != data.size() || std::fclose(f))
    fail("cannot write " + path);
}

CUtensorMapDataType tma_dtype(kda_tma_dtype d) {
  switch (d) {
    case KDA_TMA_BFLOAT16: return CU_TENSOR_MAP_DATA_TYPE_BFLOAT16;
    case KDA_TMA_FLOAT16: return CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
    case KDA_TMA_FLOAT32: return CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
  }
  fail("a TMA descriptor of unknown dtype");
}

CUtensorMapSwizzle tma_swizzle(unsigned bytes) {
  switch (bytes) {
    case 0: return CU_TENSOR_MAP_SWIZZLE_NONE;
    case 32: return CU_TENSOR_MAP_SWIZZLE_32B;
    case 64: return CU_TENSOR_MAP_SWIZZLE_64B;
    case 128: return CU_TENSOR_MAP_SWIZZLE_128B;
  }
  fail("a TMA swizzle of " + std::to_string(bytes) + " bytes");
}

// a kernel of the plan: its cubin loaded once, its function allowed the most dynamic shared
// memory any of its launches takes (set where a launch takes more than allowed so far, as
// kda_cute.launch.driver.Kernel.function does)
struct Loaded {
  const kda_kernel *kernel;
  CUmodule module;
  CUfunction function;
  unsigned allowed;
};

// the plan and the kernel table were written from one set of cubins: a launch's parameters
// must be the table's, one for one
void check_against_table(const kda_plan_op &op) {
  const kda_kernel &k = *op.kernel;
  std::string what = std::string("op '") + op.name + "' (" + k.name + "): ";
  if (op.num_params != k.num_params)
    fail(what + std::to_string(op.num_params) + " parameters in the plan, " +
         std::to_string(k.num_params) + " in the kernel table: export both again");
  for (unsigned i = 0; i < 3; ++i)
    if (op.block[i] != k.block[i]) fail(what + "the plan's block is not the kernel table's");
  for (unsigned i = 0; i < k.num_params; ++i)
    if (op.params[i].size != k.params[i].size ||
        k.params[i].offset + k.params[i].size > k.param_bytes)
      fail(what + "parameter " + k.params[i].arg + " differs from the kernel table's");
}

}  // namespace

int main(int argc, char **argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s CUBIN_DIR IN_DIR OUT_DIR\n", argv[0]);
    return 2;
  }
  const std::string cubin_dir = argv[1], in_dir = argv[2], out_dir = argv[3];

  CU(cuInit(0));
  CUdevice dev;
  CU(cuDeviceGet(&dev, 0));
  int major = 0, minor = 0;
  CU(cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev));
  CU(cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev));
  if (major != 9 || minor != 0)
    fail("the kernels are built for sm_90a, device 0 is sm_" + std::to_string(major) +
         std::to_string(minor));
  CUcontext ctx;
  CU(cuDevicePrimaryCtxRetain(&ctx, dev));
  CU(cuCtxSetCurrent(ctx));
  CUstream stream;
  CU(cuStreamCreate(&stream, CU_STREAM_DEFAULT));

  // ------------------------------------------------------------------------------ buffers
  std::vector<CUdeviceptr> alloc(KDA_PLAN_NUM_BUFFERS), base(KDA_PLAN_NUM_BUFFERS);
  for (unsigned i = 0; i < KDA_PLAN_NUM_BUFFERS; ++i) {
    const kda_plan_buffer &b = kda_plan_buffers[i];
    size_t pad = b.kind == KDA_BUFFER_WORKSPACE ? KDA_PLAN_WORKSPACE_ALIGN : 0;
    CU(cuMemAlloc(&alloc[i], b.bytes + pad + 1));  // + 1: a buffer of no bytes has an address
    base[i] = pad ? (alloc[i] + pad - 1) / pad * pad : alloc[i];
    switch (b.kind) {
      case KDA_BUFFER_INPUT: {
        std::string path = in_dir + "/" + b.name + ".bin";
        std::vector<unsigned char> data = read_file(path);
        if (data.size() != b.bytes)
          fail(path + ": expected " + std::to_string(b.bytes) + " bytes (" + b.dtype + " " +
               b.name + "), got " + std::to_string(data.size()));
        CU(cuMemcpyHtoD(base[i], data.data(), data.size()));
        break;
      }
      case KDA_BUFFER_OUTPUT:  // poisoned (NaN bits), so an element never written shows
        CU(cuMemsetD8(base[i], 0xFF, b.bytes));
        break;
      case KDA_BUFFER_CONSTANT:
        CU(cuMemcpyHtoD(base[i], b.contents, b.bytes));
        break;
      case KDA_BUFFER_ERRORS:
        CU(cuMemsetD8(base[i], 0, b.bytes));
        break;
      case KDA_BUFFER_WORKSPACE:
      case KDA_BUFFER_SCRATCH:  // any contents: the forward writes what it reads
        break;
    }
  }

  // the copies and memsets above ran on the legacy stream, and may still be running (a copy
  // from pageable memory returns once staged): done before the stream's first operation
  CU(cuCtxSynchronize());

  // ------------------------------------------------------------------------------ kernels
  std::vector<Loaded> loaded;
  for (unsigned i = 0; i < KDA_PLAN_NUM_OPS; ++i) {
    const kda_plan_op &op = kda_plan_ops[i];
    if (op.kind != KDA_OP_LAUNCH) continue;
    check_against_table(op);
    Loaded *l = nullptr;
    for (Loaded &x : loaded)
      if (x.kernel == op.kernel) l = &x;
    if (!l) {
      std::vector<unsigned char> image = read_file(cubin_dir + "/" + op.kernel->name + ".cubin");
      Loaded x{op.kernel, nullptr, nullptr, 0};
      CU(cuModuleLoadData(&x.module, image.data()));
      CU(cuModuleGetFunction(&x.function, x.module, op.kernel->entry));
      loaded.push_back(x);
      l = &loaded.back();
    }
    if (l->allowed == 0 || op.smem > l->allowed) {
      CU(cuFuncSetAttribute(l->function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            static_cast<int>(op.smem)));
      l->allowed = op.smem;
    }
  }

  // ------------------------------------------------------------------------ the operations
  for (unsigned i = 0; i < KDA_PLAN_NUM_OPS; ++i) {
    const kda_plan_op &op = kda_plan_ops[i];
    if (op.kind == KDA_OP_MEMSET_D32) {
      CU(cuMemsetD32Async(base[op.buffer] + op.offset, op.value, op.count, stream));
      continue;
    }
    const kda_kernel &k = *op.kernel;
    CUfunction f = nullptr;
    for (const Loaded &x : loaded)
      if (x.kernel == op.kernel) f = x.function;
    // the parameter block at the table's offsets (descriptors 64-byte aligned within it)
    std::vector<CUtensorMap> storage(k.param_bytes / sizeof(CUtensorMap) + 1);
    unsigned char *block = reinterpret_cast<unsigned char *>(storage.data());
    std::vector<void *> args(k.num_params);
    for (unsigned j = 0; j < k.num_params; ++j) {
      const kda_plan_param &p = op.params[j];
      unsigned char *dst = block + k.params[j].offset;
      args[j] = dst;
      if (p.recipe == KDA_PARAM_TMA) {
        CUtensorMap map;
        cuuint64_t dims[2] = {p.dims[0], p.dims[1]};
        cuuint64_t row_stride = p.row_stride_bytes;
        cuuint32_t box[2] = {p.box[0], p.box[1]}, elem[2] = {1, 1};
        CU(cuTensorMapEncodeTiled(
            &map, tma_dtype(p.dtype), p.rank,
            reinterpret_cast<void *>(base[p.buffer] + p.offset), dims, &row_stride, box, elem,
            CU_TENSOR_MAP_INTERLEAVE_NONE, tma_swizzle(p.swizzle),
            CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE));
        std::memcpy(dst, &map, sizeof map);
        continue;
      }
      std::memcpy(dst, p.bytes, p.size);
      if (p.recipe == KDA_PARAM_ADDRESS) {
        uint64_t addr = base[p.buffer] + p.offset;
        std::memcpy(dst, &addr, sizeof addr);
      }
    }
    if (!op.programmatic) {
      CU(cuLaunchKernel(f, op.grid[0], op.grid[1], op.grid[2], op.block[0], op.block[1],
                        op.block[2], op.smem, stream, args.data(), nullptr));
      continue;
    }
    CUlaunchAttribute attr;
    std::memset(&attr, 0, sizeof attr);
    attr.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    CUlaunchConfig conf;
    std::memset(&conf, 0, sizeof conf);
    conf.gridDimX = op.grid[0], conf.gridDimY = op.grid[1], conf.gridDimZ = op.grid[2];
    conf.blockDimX = op.block[0], conf.blockDimY = op.block[1], conf.blockDimZ = op.block[2];
    conf.sharedMemBytes = op.smem;
    conf.hStream = stream;
    conf.attrs = &attr;
    conf.numAttrs = 1;
    CU(cuLaunchKernelEx(&conf, f, args.data(), nullptr));
  }
  CU(cuStreamSynchronize(stream));

  // ----------------------------------------------------------------------------- results
  int status = 0;
  for (unsigned i = 0; i < KDA_PLAN_NUM_BUFFERS; ++i) {
    const kda_plan_buffer &b = kda_plan_buffers[i];
    if (b.kind == KDA_BUFFER_OUTPUT) {
      std::vector<unsigned char> data(b.bytes);
      CU(cuMemcpyDtoH(data.data(), base[i], b.bytes));
      write_file(out_dir + "/" + b.name + ".bin", data);
    } else if (b.kind == KDA_BUFFER_ERRORS) {
      std::vector<int32_t> words(b.bytes / sizeof(int32_t));
      CU(cuMemcpyDtoH(words.data(), base[i], b.bytes));
      for (size_t w = 0; w < words.size(); ++w)
        if (words[w]) {
          std::fprintf(stderr, "kda_forward: the kernels found a bad value: %s\n",
                       w < KDA_PLAN_NUM_ERROR_WORDS ? kda_plan_error_words[w] : "?");
          status = 3;
        }
    }
  }
  for (const Loaded &x : loaded) CU(cuModuleUnload(x.module));
  for (CUdeviceptr p : alloc) CU(cuMemFree(p));
  CU(cuStreamDestroy(stream));
  CU(cuDevicePrimaryCtxRelease(dev));
  if (!status)
    std::printf("kda_forward: B=%d T=%d H=%d K=%d V=%d, %d ops; outputs written to %s\n",
                KDA_PLAN_B, KDA_PLAN_T, KDA_PLAN_H, KDA_PLAN_K, KDA_PLAN_V, KDA_PLAN_NUM_OPS,
                out_dir.c_str());
  return status;
}
