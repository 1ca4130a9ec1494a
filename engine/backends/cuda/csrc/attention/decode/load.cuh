// engine/backends/cuda/attention/decode.py: _LOAD
// VEC: a lane's PER values of one position as one 4/8/16-byte load (or two), kept as
// loaded until used, instead of PER scalar loads converted at once. Measured
// vector loads through ld.global.nc converted at once (with splits of ~32 positions):
// attention 30-50% slower, not understood. Needs each position's row aligned to the
// load: true for views [:, :, :T] of the cache buffers (head_dim * itemsize bytes a row).

template <int W, typename TT>
__device__ __forceinline__ void mb_load_raw(const TT* p, uint32_t* out) {
  if constexpr (W % 4 == 0) {
#pragma unroll
    for (int j = 0; j < W / 4; ++j) {
      const uint4 u = reinterpret_cast<const uint4*>(p)[j];
      out[4 * j] = u.x;
      out[4 * j + 1] = u.y;
      out[4 * j + 2] = u.z;
      out[4 * j + 3] = u.w;
    }
  } else if constexpr (W == 2) {
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    out[0] = u.x;
    out[1] = u.y;
  } else {
    out[0] = *reinterpret_cast<const unsigned int*>(p);
  }
}
// element i of what mb_load_raw loaded, as float
__device__ __forceinline__ float mb_elem(const uint32_t* w, int i, float) {
  return __uint_as_float(w[i]);
}
__device__ __forceinline__ float mb_elem(const uint32_t* w, int i, __nv_bfloat16) {
  const uint32_t x = w[i >> 1];
  return __uint_as_float((i & 1) ? (x & 0xffff0000u) : (x << 16));
}
__device__ __forceinline__ float mb_elem(const uint32_t* w, int i, __half) {
  const uint32_t x = w[i >> 1];
  return __half2float(__ushort_as_half(static_cast<unsigned short>((i & 1) ? x >> 16 : x)));
}
