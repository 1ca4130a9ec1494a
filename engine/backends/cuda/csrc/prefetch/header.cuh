// engine/backends/cuda/prefetch.py: _HEADER

__device__ __forceinline__ void mb_pf_l2(const void* p, const size_t bytes, const size_t t,
                                         const size_t nt) {
  const char* c = static_cast<const char*>(p);
  for (size_t o = t * 128; o < bytes; o += nt * 128) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + o));
  }
}
