// engine/backends/cuda/products/wgmma.py: _HEADER_TOP

template <int BN> struct mb_n {};
__device__ __forceinline__ void mb_wg_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void mb_wg_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void mb_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}
// the threads' st.shared / cp.async writes, seen by wgmma's async proxy
__device__ __forceinline__ void mb_fence_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
__device__ __forceinline__ void mb_keep(float& v) { asm volatile("" : "+f"(v)::"memory"); }
__device__ __forceinline__ void mb_st16(uint32_t a, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(a), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w) : "memory");
}
// a shared-memory matrix descriptor: start address, leading (K) and stride (rows)
// byte offsets, no swizzle
__device__ __forceinline__ uint64_t mb_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFFu) >> 4) |
         (static_cast<uint64_t>(lbo >> 4) << 16) | (static_cast<uint64_t>(sbo >> 4) << 32);
}
struct MbWq {
  uint4 q;
  uint32_t s2, b2;
};
