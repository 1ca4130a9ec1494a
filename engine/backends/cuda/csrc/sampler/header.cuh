// engine/backends/cuda/sampler.py: _HEADER

__device__ __forceinline__ float mb_warp_sum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
// the larger value, the smaller index on a tie (mx.argmax takes the first max)
__device__ __forceinline__ void mb_argmax_merge(float& v, int& i, const float v2, const int i2) {
  if (v2 > v || (v2 == v && i2 < i)) {
    v = v2;
    i = i2;
  }
}
__device__ __forceinline__ float mb_warp_scan(float c, const int lane) {
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, c, o);
    if (lane >= o) c += y;
  }
  return c;
}
