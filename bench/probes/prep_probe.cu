// What does the prep of one (chunk, head) cost when a CTA does it chunk after chunk, as the prep
// inside a fused recurrence would? One warpgroup per CTA, chunk 16, K = 128, the bounded gate.
// Per chunk: the raw q, k, g and beta by cp.async (double-buffered), the row norms, the gate and
// its running sum per channel, the operand tiles the chain reads (qg, kg, kd in fp16, swizzled
// rows), the intra-chunk products L and Mqk on mma.sync (tf32), the inverse (I + L)^-1 by
// forward substitution on one warp, Aw = T diag(beta) and Mq = Mqk Aw. Nothing is shipped from
// here: bench/probes/prep_probe.py builds it with nvcc on the device and times it. `phases`
// (bits: 1 norms, 2 the channel pass, 4 L and Mqk, 8 the inverse, Aw and Mq) times a prefix.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace {
constexpr int C = 16, K = 128, NT = 128, PADK = K + 4;

struct Smem {
  __nv_bfloat16 raw[2][3][C][K];  // q, k, g of two chunks in flight
  float af[C][PADK];  // kn e^G, L's rows
  float aq[C][PADK];  // qn e^G scale, Mqk's rows
  float bf[C][PADK];  // kn e^-G, both products' columns
  __half qg[C][K], kg[C][K], kd[C][K];  // the chain's operands, 16-byte chunks swizzled by row
  float gl[K];
  float rq[C], rk[C], bt[C];
  float part[4][2][C][C + 1];  // each warp's partial L and Mqk over its 32 channels
  float L[C][C + 1], M[C][C + 1], T[C][C + 1];
  __half aw[C][C], mq[C][C];
};

__device__ __forceinline__ int swz(int r, int c) {  // a 128-byte swizzle of a 256-byte row
  int chunk = c >> 3;
  return ((chunk ^ (r & 7)) << 3) | (c & 7);
}

__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ void mma_tf32(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                         uint32_t a3, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// beta's bits for chunk `c` (a plain load, converted a chunk later so that nothing waits on it)
__device__ __forceinline__ unsigned short beta_bits(const __nv_bfloat16* beta, int c, int h,
                                                    int H, int T) {
  int tok = c * C + (threadIdx.x & (C - 1));
  return tok < T ? reinterpret_cast<const unsigned short*>(beta)[(size_t)tok * H + h] : 0;
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem));
}

// chunk `c` of head `h` into buffer `b`: rows of K bf16 are H*K apart in q, k and g
__device__ void load_chunk(Smem& s, int b, const __nv_bfloat16* q, const __nv_bfloat16* k,
                           const __nv_bfloat16* g, int c, int h, int H, int T) {
  const int t = threadIdx.x;
  for (int i = t; i < 3 * C * (K / 8); i += NT) {
    int which = i / (C * (K / 8)), rem = i % (C * (K / 8)), r = rem / (K / 8), p = rem % (K / 8);
    int tok = c * C + r;
    if (tok < T) {
      const __nv_bfloat16* src = which == 0 ? q : which == 1 ? k : g;
      cp_async16(&s.raw[b][which][r][p * 8], src + ((size_t)tok * H + h) * K + p * 8);
    }
  }
  asm volatile("cp.async.commit_group;");
}
}  // namespace

extern "C" __global__ void __launch_bounds__(NT) prep_probe(
    const __nv_bfloat16* q, const __nv_bfloat16* k, const __nv_bfloat16* g,
    const __nv_bfloat16* beta, const float* A_log, const float* dt_bias, int T, int H,
    int chunks_per_cta, int window, int phases, float lb, float scale, float* dump, float* sink) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int h = blockIdx.x % H, piece = blockIdx.x / H;
  const float ea = __expf(A_log[h]);
  const float dtb = dt_bias[h * K + t];
  // the CTA's chunks: its own run of the sequence, or (window > 0) a few chunks re-read from L2
  const int first = window > 0 ? 0 : piece * chunks_per_cta;
  auto chunk_of = [&](int i) { return window > 0 ? (i % window) : first + i; };
  load_chunk(s, 0, q, k, g, chunk_of(0), h, H, T);
  unsigned short bcur = beta_bits(beta, chunk_of(0), h, H, T), bnext = 0;
  float acc = 0.f;
  for (int i = 0; i < chunks_per_cta; ++i) {
    const int b = i & 1;
    if (i + 1 < chunks_per_cta) {
      load_chunk(s, b ^ 1, q, k, g, chunk_of(i + 1), h, H, T);
      bnext = beta_bits(beta, chunk_of(i + 1), h, H, T);
      asm volatile("cp.async.wait_group 1;");
    } else {
      asm volatile("cp.async.wait_group 0;");
    }
    __syncthreads();
    // row norms: eight threads a row, sixteen channels each
    if (phases & 1) {
      const int r = t >> 3, p = t & 7;
      float sq = 0.f, sk = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        float x = __bfloat162float(s.raw[b][0][r][p * 16 + j]);
        float y = __bfloat162float(s.raw[b][1][r][p * 16 + j]);
        sq += x * x;
        sk += y * y;
      }
#pragma unroll
      for (int o = 1; o < 8; o <<= 1) {
        sq += __shfl_xor_sync(0xffffffffu, sq, o);
        sk += __shfl_xor_sync(0xffffffffu, sk, o);
      }
      if (p == 0) {
        s.rq[r] = rsqrtf(sq + 1e-6f);
        s.rk[r] = rsqrtf(sk + 1e-6f);
      }
      if (t < C) s.bt[t] = 1.f / (1.f + __expf(-__bfloat162float(__ushort_as_bfloat16(bcur))));
    }
    __syncthreads();
    // one channel a thread: the gate, its running sum, the operands
    if (phases & 2) {
      float G[C];
      float run = 0.f;
#pragma unroll
      for (int r = 0; r < C; ++r) {
        float x = ea * (__bfloat162float(s.raw[b][2][r][t]) + dtb);
        run += __fdividef(lb, 1.f + __expf(-x));
        G[r] = run;
      }
      const float egl = __expf(run);
      s.gl[t] = run;
#pragma unroll
      for (int r = 0; r < C; ++r) {
        const float e = __expf(G[r]), ei = __expf(-G[r]);
        const float kn = __bfloat162float(s.raw[b][1][r][t]) * s.rk[r];
        const float qn = __bfloat162float(s.raw[b][0][r][t]) * s.rq[r];
        s.af[r][t] = kn * e;
        s.aq[r][t] = qn * e * scale;
        s.bf[r][t] = kn * ei;
        const int c = swz(r, t);
        s.qg[r][c] = __float2half_rn(qn * e * scale);
        s.kg[r][c] = __float2half_rn(kn * e);
        s.kd[r][c] = __float2half_rn(kn * egl * ei);
      }
    }
    __syncthreads();
    // L and Mqk: each warp sums its 32 channels on mma.sync, the four partials added below
    if (phases & 4) {
      const int gq = lane >> 2, tq = lane & 3;
      float cl[2][4] = {}, cm[2][4] = {};
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const int cb = warp * 32 + kk * 8;
        const uint32_t l0 = tf32(s.af[gq][cb + tq]), l1 = tf32(s.af[gq + 8][cb + tq]);
        const uint32_t l2 = tf32(s.af[gq][cb + tq + 4]), l3 = tf32(s.af[gq + 8][cb + tq + 4]);
        const uint32_t m0 = tf32(s.aq[gq][cb + tq]), m1 = tf32(s.aq[gq + 8][cb + tq]);
        const uint32_t m2 = tf32(s.aq[gq][cb + tq + 4]), m3 = tf32(s.aq[gq + 8][cb + tq + 4]);
#pragma unroll
        for (int n = 0; n < 2; ++n) {
          const uint32_t b0 = tf32(s.bf[n * 8 + gq][cb + tq]);
          const uint32_t b1 = tf32(s.bf[n * 8 + gq][cb + tq + 4]);
          mma_tf32(cl[n], l0, l1, l2, l3, b0, b1);
          mma_tf32(cm[n], m0, m1, m2, m3, b0, b1);
        }
      }
#pragma unroll
      for (int n = 0; n < 2; ++n) {
        const int col = n * 8 + 2 * tq;
        s.part[warp][0][gq][col] = cl[n][0];
        s.part[warp][0][gq][col + 1] = cl[n][1];
        s.part[warp][0][gq + 8][col] = cl[n][2];
        s.part[warp][0][gq + 8][col + 1] = cl[n][3];
        s.part[warp][1][gq][col] = cm[n][0];
        s.part[warp][1][gq][col + 1] = cm[n][1];
        s.part[warp][1][gq + 8][col] = cm[n][2];
        s.part[warp][1][gq + 8][col + 1] = cm[n][3];
      }
    }
    __syncthreads();
    for (int e = t; (phases & 4) && e < 2 * C * C; e += NT) {
      const int which = e / (C * C), i = (e / C) % C, j = e % C;
      float v = s.part[0][which][i][j] + s.part[1][which][i][j] + s.part[2][which][i][j] +
                s.part[3][which][i][j];
      if (which == 0) {
        s.L[i][j] = j < i ? s.bt[i] * v : 0.f;
      } else {
        s.M[i][j] = j <= i ? v : 0.f;
      }
    }
    __syncthreads();
    // T = (I + L)^-1, unit lower triangular: a column a lane pair, each half of every row's sum
    if ((phases & 8) && warp == 0) {
      const int j = lane & 15, half = lane >> 4;
      float col[C];
#pragma unroll
      for (int r = 0; r < C; ++r) {
        float part = 0.f;
#pragma unroll
        for (int m = 0; m < r; ++m) part -= (m & 1) == half ? s.L[r][m] * col[m] : 0.f;
        part += __shfl_xor_sync(0xffffffffu, part, 16);
        col[r] = (r == j ? 1.f : 0.f) + part;
      }
      if (half == 0) {
#pragma unroll
        for (int r = 0; r < C; ++r) s.T[r][j] = col[r];
      }
    }
    __syncthreads();
    // Aw = T diag(beta), Mq = Mqk Aw (both lower triangular)
    for (int e = t; (phases & 8) && e < C * C; e += NT) {
      const int i = e / C, j = e % C;
      float aw = j <= i ? s.T[i][j] * s.bt[j] : 0.f;
      float mq = 0.f;
      for (int m = j; m <= i; ++m) mq += s.M[i][m] * s.T[m][j];
      mq *= s.bt[j];
      s.aw[i][j] = __float2half_rn(aw);
      s.mq[i][j] = __float2half_rn(mq);
    }
    __syncthreads();
    if (dump != nullptr) {  // validation: every output of this chunk, fp32, unswizzled
      float* d = dump + ((size_t)h * chunks_per_cta + i) * (3 * C * K + K + 2 * C * C);
      for (int r = 0; r < C; ++r) {
        const int c = swz(r, t);
        d[r * K + t] = __half2float(s.qg[r][c]);
        d[C * K + r * K + t] = __half2float(s.kg[r][c]);
        d[2 * C * K + r * K + t] = __half2float(s.kd[r][c]);
      }
      d[3 * C * K + t] = s.gl[t];
      for (int e = t; e < C * C; e += NT) {
        d[3 * C * K + K + e] = __half2float(s.aw[e / C][e % C]);
        d[3 * C * K + K + C * C + e] = __half2float(s.mq[e / C][e % C]);
      }
    }
    acc += __half2float(s.kd[t >> 3][t]) + __half2float(s.mq[t >> 3][t & 15]);
    bcur = bnext;
    __syncthreads();
  }
  sink[blockIdx.x * NT + t] = acc;  // what the chunks computed, kept
}

extern "C" int prep_probe_smem() { return sizeof(Smem); }

extern "C" int prep_probe_launch(const void* q, const void* k, const void* g, const void* beta,
                                 const float* A_log, const float* dt_bias, int T, int H,
                                 int ctas, int chunks_per_cta, int window, int phases, float lb,
                                 float scale, float* dump, float* sink, void* stream) {
  static bool set = false;
  if (!set) {
    cudaError_t e = cudaFuncSetAttribute(prep_probe, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)sizeof(Smem));
    if (e != cudaSuccess) return (int)e;
    set = true;
  }
  prep_probe<<<ctas, NT, sizeof(Smem), (cudaStream_t)stream>>>(
      (const __nv_bfloat16*)q, (const __nv_bfloat16*)k, (const __nv_bfloat16*)g,
      (const __nv_bfloat16*)beta, A_log, dt_bias, T, H, chunks_per_cta, window, phases, lb, scale,
      dump, sink);
  return (int)cudaGetLastError();
}

extern "C" int prep_probe_occupancy() {
  int n = 0;
  cudaFuncSetAttribute(prep_probe, cudaFuncAttributeMaxDynamicSharedMemorySize,
                       (int)sizeof(Smem));
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, prep_probe, NT, sizeof(Smem));
  return n;
}
