// engine/backends/cuda/products/qstream.py: _HEADER

__device__ __forceinline__ void mb_cp16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void mb_cp4(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(s), "l"(src) : "memory");
}
__device__ __forceinline__ void mb_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void mb_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// a lane's ring of S shared-memory slots: chunk q is asked for (issue(q): its cp.async
// copies) S - 1 chunks before compute(q's slot) uses it, one commit group a chunk, so
// the slot written is always the one the chunk before used
template <int S, typename Issue>
__device__ __forceinline__ void mb_ring_start(const int total, Issue& issue) {
#pragma unroll
  for (int p = 0; p < S - 1; ++p) {
    if (p < total) {
      issue(p);
    }
    mb_commit();
  }
}
// STARTED: the caller has run mb_ring_start already (its loads in flight while it did
// other work: the integer form's x conversion)
template <int S, bool STARTED = false, typename Issue, typename Compute>
__device__ __forceinline__ void mb_ring(const int total, Issue& issue, Compute&& compute) {
  if constexpr (!STARTED) {
    mb_ring_start<S>(total, issue);
  }
  for (int q = 0; q < total; ++q) {
    if (q + S - 1 < total) {
      issue(q + S - 1);
    }
    mb_commit();
    mb_wait<S - 1>();  // chunk q's group is complete
    compute(q % S);
  }
}
// one of the two 16-bit values of a word (hi: the upper) as float
__device__ __forceinline__ float mb_half_of(uint32_t v, bool hi, __nv_bfloat16) {
  return __uint_as_float(hi ? (v & 0xffff0000u) : (v << 16));
}
__device__ __forceinline__ float mb_half_of(uint32_t v, bool hi, __half) {
  const uint16_t h = static_cast<uint16_t>(hi ? (v >> 16) : (v & 0xffffu));
  return __half2float(*reinterpret_cast<const __half*>(&h));
}
__device__ __forceinline__ constexpr bool mb_is_half(__half) { return true; }
__device__ __forceinline__ constexpr bool mb_is_half(__nv_bfloat16) { return false; }
// a + two 16 x 8-bit products: the int16 pair of x with bytes 0, 1 (lo) or 2, 3 (hi) of b
__device__ __forceinline__ int mb_dp2a_lo(uint32_t x, uint32_t b, int c) {
  int d;
  asm("dp2a.lo.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ int mb_dp2a_hi(uint32_t x, uint32_t b, int c) {
  int d;
  asm("dp2a.hi.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(b), "r"(c));
  return d;
}
// the same with b's bytes unsigned (0..255)
__device__ __forceinline__ int mb_dp2a_lo_u(uint32_t x, uint32_t b, int c) {
  int d;
  asm("dp2a.lo.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ int mb_dp2a_hi_u(uint32_t x, uint32_t b, int c) {
  int d;
  asm("dp2a.hi.s32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(x), "r"(b), "r"(c));
  return d;
}
// 2^23 + (w & mask) as float (magic: 0x4B000000), minus 2^23: the masked bits' value, exact
__device__ __forceinline__ float mb_nib(uint32_t w, uint32_t mask, uint32_t magic) {
  return __uint_as_float((w & mask) | magic) - 8388608.f;
}
