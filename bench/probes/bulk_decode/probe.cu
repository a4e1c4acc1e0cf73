// A decode step on an fp32 or bf16 pool whose state tiles move by the bulk copy engine, in CUDA C++, to
// see whether that memory structure takes a decode (not only a stream of its bytes: see
// bench/probes/gather_stream/probe.cu) to the serving bar at N x H = 2048-3072. Built by
// bench/probes/bulk_decode_probe.py with nvcc (sm_90a); nothing here is shipped.
//
// The math is kda_cute.decode's with gate="bounded", qk_l2norm, beta logits, K = V = 128:
//   a = lower_bound sigmoid(exp(A_log) (g + dt_bias));  S = S exp(a);  u = beta (v - S kn);
//   S = S + u kn^T;  o = S (scale qn) = Sd qn scale + u (kn . qn scale)
// Tile t is ROWS state rows of one (row n, head h): part t % parts of head (t / parts) % H of
// row t / (parts H), read from and written back to slot idx[n] (>= 0: no padding here).
//
// A persistent grid; a CTA is WARPS consumer warps and one producer warp. The producer's lane 0
// looks up each of the CTA's tiles' slot and moves the tile into one of STAGES shared buffers
// (cp.async.bulk global -> shared, completing `full`), and, once every consumer warp has
// arrived on `empty` (its rows updated in place in the buffer), moves it back out
// (cp.async.bulk shared -> global) and refills the buffer when that store has read it. A
// consumer warp takes the tile's rows w, w + WARPS, .. a row at a time, lane l holding columns
// 4l .. 4l + 3 (one 16-byte shared access a lane: a row is 512 contiguous bytes), and does the
// token's math (norms, gate, beta) itself for each tile.
#include <cstdint>
#include <cuda_bf16.h>

struct Dec {
  const __nv_bfloat16 *q, *k, *g, *v, *beta;  // [N, H*K], [N, H*V], [N, H]
  __nv_bfloat16* out;                         // [N, H*V]
  const float *a_log, *dt_bias;               // [H], [H*K]
  const int* idx;                             // [N]
  void* pool;                                 // [slots, H, V, K], fp32 or bf16
  long long slot_stride;                      // elements
  int heads;
  int parts;  // V / ROWS
  int tiles;  // N * H * parts
  float scale, lower_bound;
};

constexpr int K = 128, V = 128;

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

__device__ __forceinline__ void wait_parity(uint32_t mb, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile(
        "{ .reg .pred q; mbarrier.try_wait.parity.shared::cta.b64 q, [%1], %2; selp.u32 %0, 1, 0, q; }"
        : "=r"(done)
        : "r"(mb), "r"(parity)
        : "memory");
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ void load4(const __nv_bfloat16* p, float* f) {
  uint2 w = *reinterpret_cast<const uint2*>(p);
  __nv_bfloat162 a = *reinterpret_cast<__nv_bfloat162*>(&w.x);
  __nv_bfloat162 b = *reinterpret_cast<__nv_bfloat162*>(&w.y);
  f[0] = __low2float(a);
  f[1] = __high2float(a);
  f[2] = __low2float(b);
  f[3] = __high2float(b);
}

// a lane's 4 columns of a state row in shared memory, as fp32 (E: the pool's element)
__device__ __forceinline__ void get4(const float* row, int lane, float* x) {
  float4 v = reinterpret_cast<const float4*>(row)[lane];
  x[0] = v.x, x[1] = v.y, x[2] = v.z, x[3] = v.w;
}
__device__ __forceinline__ void put4(float* row, int lane, const float* x) {
  reinterpret_cast<float4*>(row)[lane] = make_float4(x[0], x[1], x[2], x[3]);
}
__device__ __forceinline__ void get4(const __nv_bfloat16* row, int lane, float* x) {
  load4(row + 4 * lane, x);
}
__device__ __forceinline__ void put4(__nv_bfloat16* row, int lane, const float* x) {
  __nv_bfloat162 a = __floats2bfloat162_rn(x[0], x[1]), b = __floats2bfloat162_rn(x[2], x[3]);
  uint2 w;
  w.x = *reinterpret_cast<uint32_t*>(&a);
  w.y = *reinterpret_cast<uint32_t*>(&b);
  reinterpret_cast<uint2*>(row)[lane] = w;
}

template <typename E, int ROWS, int STAGES, int WARPS>
__device__ __forceinline__ void decode_bulk(const Dec& p) {
  constexpr int TILE = ROWS * K * (int)sizeof(E);
  constexpr int PER = ROWS / WARPS;  // rows a consumer warp takes of a tile
  static_assert(PER <= 32 && ROWS % WARPS == 0, "a lane holds one row's v");
  extern __shared__ __align__(128) char buf[];  // STAGES tiles
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int mine = p.tiles > (int)blockIdx.x ? (p.tiles - 1 - blockIdx.x) / gridDim.x + 1 : 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; s++) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_u32(&full[s])));
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(&empty[s])),
                   "r"(WARPS));
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  auto at = [&](int i) -> E* {  // the pool address of this CTA's i-th tile
    int t = blockIdx.x + i * gridDim.x;
    int part = t % p.parts, h = (t / p.parts) % p.heads, n = t / (p.parts * p.heads);
    long long s = p.idx[n];
    return reinterpret_cast<E*>(p.pool) + s * p.slot_stride + ((long long)h * V + part * ROWS) * K;
  };
  if (warp == WARPS) {  // the producer
    if (lane != 0) return;
    auto load = [&](int i) {
      int b = i % STAGES;
      uint32_t mb = smem_u32(&full[b]);
      asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(mb), "r"(TILE)
                   : "memory");
      asm volatile(
          "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
          ::"r"(smem_u32(buf + b * TILE)), "l"(at(i)), "r"(TILE), "r"(mb)
          : "memory");
    };
    for (int i = 0; i < STAGES && i < mine; i++) load(i);
    for (int i = 0; i < mine; i++) {
      int b = i % STAGES;
      wait_parity(smem_u32(&empty[b]), (i / STAGES) & 1);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(at(i)),
                   "r"(smem_u32(buf + b * TILE)), "r"(TILE)
                   : "memory");
      asm volatile("cp.async.bulk.commit_group;" ::: "memory");
      // the store before this one has read its buffer: refill it
      asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
      if (i >= 1 && i - 1 + STAGES < mine) load(i - 1 + STAGES);
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
    return;
  }
  for (int i = 0; i < mine; i++) {
    int t = blockIdx.x + i * gridDim.x;
    int part = t % p.parts, h = (t / p.parts) % p.heads, n = t / (p.parts * p.heads);
    // the token's loads and math (every consumer warp its own)
    float qv[4], kv[4], dv[4], bias[4];
    long long tk = (long long)n * p.heads * K + h * K + 4 * lane;
    load4(p.q + tk, qv);
    load4(p.k + tk, kv);
    load4(p.g + tk, dv);
    float4 bb = *reinterpret_cast<const float4*>(p.dt_bias + h * K + 4 * lane);
    bias[0] = bb.x, bias[1] = bb.y, bias[2] = bb.z, bias[3] = bb.w;
    float a_exp = __expf(p.a_log[h]);
    float b_raw = __bfloat162float(p.beta[(long long)n * p.heads + h]);
    int vrow = part * ROWS + warp + WARPS * lane;
    float vmine = lane < PER ? __bfloat162float(p.v[(long long)n * p.heads * V + h * V + vrow])
                             : 0.f;
    float sq = 0.f, sk = 0.f;
#pragma unroll
    for (int c = 0; c < 4; c++) sq += qv[c] * qv[c], sk += kv[c] * kv[c];
    sq = warp_sum(sq);
    sk = warp_sum(sk);
    float rq = p.scale * rsqrtf(sq + 1e-6f), rk = rsqrtf(sk + 1e-6f);
    float kq = 0.f;
#pragma unroll
    for (int c = 0; c < 4; c++) {
      qv[c] *= rq;
      kv[c] *= rk;
      kq += kv[c] * qv[c];
      float y = a_exp * (dv[c] + bias[c]);
      float sg = __frcp_rn(1.f + __expf(-y));
      dv[c] = __expf(p.lower_bound * sg);
    }
    kq = warp_sum(kq);
    float beta = __frcp_rn(1.f + __expf(-b_raw));
    // the tile
    int b = i % STAGES;
    wait_parity(smem_u32(&full[b]), (i / STAGES) & 1);
    E* tile = reinterpret_cast<E*>(buf + b * TILE);
    __nv_bfloat16* orow = p.out + (long long)n * p.heads * V + h * V + part * ROWS;
#pragma unroll 2
    for (int j = 0; j < PER; j++) {
      int r = warp + WARPS * j;
      float x[4];
      get4(tile + r * K, lane, x);
      float a = 0.f, o = 0.f;
#pragma unroll
      for (int c = 0; c < 4; c++) {
        x[c] *= dv[c];
        a -= x[c] * kv[c];
        o += x[c] * qv[c];
      }
      a = warp_sum(a);
      o = warp_sum(o);
      float u = beta * (__shfl_sync(0xffffffffu, vmine, j) + a);
#pragma unroll
      for (int c = 0; c < 4; c++) x[c] += u * kv[c];
      put4(tile + r * K, lane, x);
      if (lane == 0) orow[r] = __float2bfloat16(o + u * kq);
    }
    // this warp's rows are in the buffer: visible to the bulk copy, then the producer told
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    __syncwarp();
    if (lane == 0)
      asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(&empty[b]))
                   : "memory");
  }
}

#define DECODE(ROWS, STAGES, WARPS)                                                          \
  extern "C" __global__ void __launch_bounds__(32 * (WARPS + 1))                             \
      decode_bulk_##ROWS##_##STAGES##_##WARPS(Dec p) {                                       \
    decode_bulk<float, ROWS, STAGES, WARPS>(p);                                              \
  }                                                                                          \
  extern "C" __global__ void __launch_bounds__(32 * (WARPS + 1))                             \
      decode_bulk_bf16_##ROWS##_##STAGES##_##WARPS(Dec p) {                                  \
    decode_bulk<__nv_bfloat16, ROWS, STAGES, WARPS>(p);                                      \
  }
DECODE(32, 4, 4)
DECODE(32, 6, 4)
DECODE(32, 6, 8)
DECODE(32, 8, 4)
DECODE(64, 3, 4)
DECODE(64, 3, 8)
DECODE(64, 6, 4)
DECODE(16, 8, 4)
DECODE(16, 12, 4)
