// engine/backends/cuda/products/qgemm.py: PAIR
// a 16-bit scale or bias as the pair (h, h) that gpu_mma's mb_deq2 takes (also
// engine/backends/cuda/products/wgmma.py's)

__device__ __forceinline__ uint32_t mb_pair(uint16_t h) {
  return static_cast<uint32_t>(h) * 0x10001u;
}
template <typename TT>
__device__ __forceinline__ uint32_t mb_pair(TT v) {
  return mb_pair(*reinterpret_cast<const uint16_t*>(&v));
}
