// engine/backends/cuda/products/dequant.py: _HEADER

// two 4-bit values (bits 0-3 and 4-7 of v) as the pair (q0 * s + b, q1 * s + b), written
// as MLX's affine_dequantize writes it (scale * q + bias; contracted into one fma)
__device__ __forceinline__ uint32_t mb_dq2(uint32_t v, uint32_t s2, uint32_t b2, __nv_bfloat16) {
  const uint32_t bits = (v & 0xFu) | ((v & 0xF0u) << 12) | 0x43004300u;
  __nv_bfloat162 q = *reinterpret_cast<const __nv_bfloat162*>(&bits);
  q = __hsub2(q, __floats2bfloat162_rn(128.f, 128.f));  // 128 + q - 128: exact
  const __nv_bfloat162 r = __hadd2(__hmul2(q, *reinterpret_cast<const __nv_bfloat162*>(&s2)),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t mb_dq2(uint32_t v, uint32_t s2, uint32_t b2, __half) {
  const uint32_t bits = (v & 0xFu) | ((v & 0xF0u) << 12) | 0x64006400u;
  __half2 q = *reinterpret_cast<const __half2*>(&bits);
  q = __hsub2(q, __floats2half2_rn(1024.f, 1024.f));
  const __half2 r = __hadd2(__hmul2(q, *reinterpret_cast<const __half2*>(&s2)),
                            *reinterpret_cast<const __half2*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&r);
}
// a 16-bit scale or bias as the pair (h, h)
template <typename TT>
__device__ __forceinline__ uint32_t mb_dup(TT v) {
  return static_cast<uint32_t>(*reinterpret_cast<const uint16_t*>(&v)) * 0x10001u;
}
