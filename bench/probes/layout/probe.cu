// DRAM efficiency of K2's workspace tile pattern: each CTA reads (or writes) tiles of 16 rows x
// 256 bytes, the rows either `stride` bytes apart (token-major workspace: stride = H * 256) or
// contiguous (head-major: one 4 KB block). Built and timed by bench/probes/layout_probe.py.
#include <cstdint>

// element `threadIdx.x` (16 rows x 16 lanes of 16 bytes) of tile t (head t % heads, chunk
// t / heads), in uint4 units: rows row_stride16 apart, or (row_stride16 == 0) one 4 KB block
__device__ __forceinline__ long long tile_offset(long long t, long long tiles,
                                                 long long row_stride16, int heads) {
  long long h = t % heads, c = t / heads;
  int row = threadIdx.x / 16, col = threadIdx.x % 16;
  return row_stride16 ? (c * 16 + row) * row_stride16 + h * 16 + col
                      : (h * (tiles / heads) + c) * 256 + row * 16 + col;
}

extern "C" __global__ void __launch_bounds__(256) tiles_read(const uint4* __restrict__ src,
                                                             uint4* __restrict__ sink,
                                                             long long tiles, long long row_stride16,
                                                             int heads, int tiles_per_cta) {
  uint4 acc = make_uint4(0, 0, 0, 0);
  for (int i = 0; i < tiles_per_cta; i++) {
    long long t = (long long)blockIdx.x * tiles_per_cta + i;
    if (t >= tiles) break;
    uint4 v = __ldcs(src + tile_offset(t, tiles, row_stride16, heads));
    acc.x ^= v.x; acc.y ^= v.y; acc.z ^= v.z; acc.w ^= v.w;
  }
  if ((acc.x ^ acc.y ^ acc.z ^ acc.w) == 0x12345678u) sink[threadIdx.x] = acc;
}

extern "C" __global__ void __launch_bounds__(256) tiles_write(uint4* __restrict__ dst,
                                                              long long tiles, long long row_stride16,
                                                              int heads, int tiles_per_cta) {
  for (int i = 0; i < tiles_per_cta; i++) {
    long long t = (long long)blockIdx.x * tiles_per_cta + i;
    if (t >= tiles) break;
    __stcs(dst + tile_offset(t, tiles, row_stride16, heads),
           make_uint4(t, i, threadIdx.x / 16, threadIdx.x % 16));
  }
}
