// Residency probe kernels: a "host" kernel mimicking a resident K2 CTA (its threads and register
// count, idle at a flag) and a "guest" mimicking K1's CTA (128 threads, 64 registers), which logs
// (SM, start, end) so the host script can count how many guests ran at once beside each host.
// Built by bench/probes/residency_probe.py with nvcc (sm_90a); nothing here is shipped.
#include <cstdint>

__device__ __forceinline__ uint64_t gtimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ unsigned smid() {
  unsigned s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}

// NLIVE values stay live across the wait, so the kernel allocates up to its register cap
template <int NLIVE>
__device__ __forceinline__ void hold_live(const float* src, float* sink, const volatile int* release,
                                          uint64_t spin_ns, unsigned long long* log) {
  float v[NLIVE];
#pragma unroll
  for (int i = 0; i < NLIVE; i++) v[i] = src[(threadIdx.x * 7 + i) & 4095];
  uint64_t t0 = gtimer();
  if (threadIdx.x == 0) {
    log[blockIdx.x * 4 + 0] = smid();
    log[blockIdx.x * 4 + 1] = t0;
  }
  while (release ? *release == 0 : gtimer() - t0 < spin_ns) __nanosleep(1000);
  if (threadIdx.x == 0) log[blockIdx.x * 4 + 2] = gtimer();
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < NLIVE; i++) s = s * 1.0001f + v[i];
  if (s == 1234.5f) sink[threadIdx.x] = s;
}

#define HOST(R)                                                                                  \
  extern "C" __global__ void __maxnreg__(R) host_r##R(const float* src, float* sink,            \
                                                      const volatile int* release,               \
                                                      unsigned long long* log) {                 \
    hold_live<R + 40>(src, sink, release, 0, log);                                               \
  }
HOST(168)
HOST(160)
HOST(128)

// as host_r168, but warps from `first_small` on give registers back (setmaxnreg.dec to 24) and
// wait with few live values: a producer warp's shape after a dealloc
extern "C" __global__ void __maxnreg__(168) host_r168_dec(const float* src, float* sink,
                                                          const volatile int* release,
                                                          unsigned long long* log) {
  if (threadIdx.x / 32 >= 4) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n" ::: "memory");
    while (*release == 0) __nanosleep(1000);
    return;
  }
  hold_live<208>(src, sink, release, 0, log);
}

extern "C" __global__ void __maxnreg__(64) guest_r64(const float* src, float* sink,
                                                     unsigned long long spin_ns,
                                                     unsigned long long* log) {
  hold_live<104>(src, sink, nullptr, spin_ns, log);
}
