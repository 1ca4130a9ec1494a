// engine/backends/cuda/products/mma.py: _HEADER

__device__ __forceinline__ void mb_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1, __nv_bfloat16) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mb_mma(float* c, uint32_t a0, uint32_t a1, uint32_t a2,
                                       uint32_t a3, uint32_t b0, uint32_t b1, __half) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint4 mb_ldg(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}
__device__ __forceinline__ uint32_t mb_word(const uint4& u, int i) {
  return i == 0 ? u.x : i == 1 ? u.y : i == 2 ? u.z : u.w;
}
// two 4-bit values (bits 0-3 and 4-7 of v) as a bf16/fp16 pair q*s + b
__device__ __forceinline__ uint32_t mb_deq2(uint32_t v, uint32_t s2, uint32_t b2, __nv_bfloat16) {
  const uint32_t bits = (v & 0xFu) | ((v & 0xF0u) << 12) | 0x43004300u;
  __nv_bfloat162 q = *reinterpret_cast<const __nv_bfloat162*>(&bits);
  const __nv_bfloat162 k = __floats2bfloat162_rn(128.f, 128.f);
  q = __hsub2(q, k);
  const __nv_bfloat162 r = __hfma2(q, *reinterpret_cast<const __nv_bfloat162*>(&s2),
                                   *reinterpret_cast<const __nv_bfloat162*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t mb_deq2(uint32_t v, uint32_t s2, uint32_t b2, __half) {
  const uint32_t bits = (v & 0xFu) | ((v & 0xF0u) << 12) | 0x64006400u;
  __half2 q = *reinterpret_cast<const __half2*>(&bits);
  q = __hsub2(q, __floats2half2_rn(1024.f, 1024.f));
  const __half2 r = __hfma2(q, *reinterpret_cast<const __half2*>(&s2),
                            *reinterpret_cast<const __half2*>(&b2));
  return *reinterpret_cast<const uint32_t*>(&r);
}
