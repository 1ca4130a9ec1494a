// engine/backends/cuda/attention/prefill.py: _HEADER

__device__ __forceinline__ uint32_t mb_pack2(float lo, float hi, __nv_bfloat16) {
  const __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&r);
}
__device__ __forceinline__ uint32_t mb_pack2(float lo, float hi, __half) {
  const __half2 r = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&r);
}
// 16 bytes global -> shared without a register; zeros when !valid (src-size 0); the
// destination as a shared-space address (mb_cp16s) or a generic pointer (mb_cp16z)
__device__ __forceinline__ void mb_cp16s(uint32_t d, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src),
               "r"(valid ? 16 : 0) : "memory");
}
__device__ __forceinline__ void mb_cp16z(void* dst, const void* src, bool valid) {
  mb_cp16s(static_cast<uint32_t>(__cvta_generic_to_shared(dst)), src, valid);
}
__device__ __forceinline__ void mb_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
// until at most N of this thread's commit groups are still in flight (as gpu_qstream's)
template <int N>
__device__ __forceinline__ void mb_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
// four 8x8 b16 matrices from shared memory; lane l gives row l % 8 of matrix l / 8,
// and gets in r[i] what an MMA fragment holds of matrix i (.trans: of its transpose)
__device__ __forceinline__ void mb_ldm4(uint32_t* r, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void mb_ldm4t(uint32_t* r, const void* p) {
  const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
template <typename T>
__device__ __forceinline__ uint32_t mb_join2(T lo, T hi) {
  return static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&lo)) |
         (static_cast<uint32_t>(*reinterpret_cast<const unsigned short*>(&hi)) << 16);
}
