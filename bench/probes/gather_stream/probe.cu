// Gather streams in CUDA C++: a decode's state bytes (the touched slots of a pool, each head's
// state one contiguous block) read and written back in place by kernels that do nothing else,
// to bound what any decode can reach at a shape. Built by bench/probes/gather_stream_probe.py
// with nvcc (sm_90a); nothing here is shipped.
//
// A tile is `tile_bytes` of one (slot, head) block: tile t is part t % parts of head
// (t / parts) % heads of row t / (parts * heads), whose slot is idx[row]. Each kernel reads it
// from `pool` and writes it to the same place in `out` (the timed runs pass out = pool: in
// place, as a decode; a check passes another buffer and compares).
//   vec_*:  a CTA a tile, every thread's 16-byte loads issued before any store.
//   flat_*: a persistent grid over (tile, 16-byte chunk) units, UNROLL units a thread at a time
//           (loads all issued, then the stores), so a thread keeps UNROLL loads in flight.
//   bulk_*: a persistent grid of one-warp CTAs; one thread moves whole tiles with the bulk copy
//           engine (cp.async.bulk global -> shared on an mbarrier, then shared -> global), up to
//           STAGES tiles in flight a CTA.
#include <cstdint>

struct Tiles {
  const int* idx;
  const char* pool;
  char* out;
  long long slot_stride;  // bytes
  int heads;
  int head_bytes;  // V * K * element size
  int tile_bytes;
  int parts;  // head_bytes / tile_bytes
  int tiles;  // rows * heads * parts
};

__device__ __forceinline__ long long tile_at(const Tiles& p, int t) {  // byte offset
  int part = t % p.parts;
  int h = (t / p.parts) % p.heads;
  int n = t / (p.parts * p.heads);
  long long s = p.idx[n];
  return s * p.slot_stride + (long long)h * p.head_bytes + (long long)part * p.tile_bytes;
}

template <int TILE, int THREADS>
__device__ __forceinline__ void vec_tile(const Tiles& p) {
  constexpr int PER = TILE / 16 / THREADS;
  long long off = tile_at(p, blockIdx.x);
  const uint4* src = reinterpret_cast<const uint4*>(p.pool + off);
  uint4* dst = reinterpret_cast<uint4*>(p.out + off);
  uint4 r[PER];
#pragma unroll
  for (int i = 0; i < PER; i++) r[i] = src[i * THREADS + threadIdx.x];
#pragma unroll
  for (int i = 0; i < PER; i++) dst[i * THREADS + threadIdx.x] = r[i];
}

#define VEC(TILE, THREADS)                                                                     \
  extern "C" __global__ void __launch_bounds__(THREADS) vec_##TILE##_##THREADS(Tiles p) {     \
    vec_tile<TILE, THREADS>(p);                                                                \
  }
VEC(4096, 128)
VEC(8192, 128)
VEC(16384, 128)
VEC(16384, 256)
VEC(32768, 256)
VEC(32768, 512)

template <int UNROLL>
__device__ __forceinline__ void flat(const Tiles& p) {
  const int per_tile = p.tile_bytes / 16;
  const long long units = (long long)p.tiles * per_tile;
  const long long step = (long long)gridDim.x * blockDim.x;
  for (long long u0 = (long long)blockIdx.x * blockDim.x + threadIdx.x; u0 < units;
       u0 += step * UNROLL) {
    long long a[UNROLL];  // byte offsets, -1: past the end
    uint4 r[UNROLL];
#pragma unroll
    for (int i = 0; i < UNROLL; i++) {
      long long u = u0 + i * step;
      a[i] = -1;
      if (u < units) {
        int t = (int)(u / per_tile);
        a[i] = tile_at(p, t) + (u - (long long)t * per_tile) * 16;
        r[i] = *reinterpret_cast<const uint4*>(p.pool + a[i]);
      }
    }
#pragma unroll
    for (int i = 0; i < UNROLL; i++)
      if (a[i] >= 0) *reinterpret_cast<uint4*>(p.out + a[i]) = r[i];
  }
}

#define FLAT(UNROLL) \
  extern "C" __global__ void __launch_bounds__(256) flat_##UNROLL(Tiles p) { flat<UNROLL>(p); }
FLAT(1)
FLAT(2)
FLAT(4)
FLAT(8)

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

template <int STAGES>
__device__ __forceinline__ void bulk(const Tiles& p) {
  extern __shared__ __align__(128) char buf[];  // STAGES tiles
  __shared__ __align__(8) uint64_t bar[STAGES];
  if (threadIdx.x != 0) return;
  for (int s = 0; s < STAGES; s++)
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&bar[s])));
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  const int mine = p.tiles > (int)blockIdx.x ? (p.tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  auto load = [&](int i) {  // this CTA's i-th tile into buffer i % STAGES
    int b = i % STAGES;
    const char* src = p.pool + tile_at(p, blockIdx.x + i * gridDim.x);
    uint32_t mb = smem_u32(&bar[b]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mb),
                 "r"(p.tile_bytes)
                 : "memory");
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
        ::"r"(smem_u32(buf + b * p.tile_bytes)), "l"(src), "r"(p.tile_bytes), "r"(mb)
        : "memory");
  };
  for (int i = 0; i < STAGES && i < mine; i++) load(i);
  for (int i = 0; i < mine; i++) {
    int b = i % STAGES;
    uint32_t mb = smem_u32(&bar[b]);
    uint32_t parity = (i / STAGES) & 1;
    uint32_t done = 0;
    while (!done)
      asm volatile(
          "{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
          : "=r"(done)
          : "r"(mb), "r"(parity)
          : "memory");
    char* dst = p.out + tile_at(p, blockIdx.x + i * gridDim.x);
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
                 "r"(smem_u32(buf + b * p.tile_bytes)), "r"(p.tile_bytes)
                 : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    if (i + STAGES < mine) {
      // buffer b is read by the store just issued: wait for that read before refilling it
      asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory");
      load(i + STAGES);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

#define BULK(STAGES) \
  extern "C" __global__ void __launch_bounds__(32) bulk_##STAGES(Tiles p) { bulk<STAGES>(p); }
BULK(2)
BULK(3)
BULK(4)
BULK(6)
