// engine/backends/cuda/attention/decode.py: LAST_BLOCK
// Whether this block is the last of the ``n`` blocks of its (row, KV head) to get here
// (each counts itself on ``cnt``, which is zero between launches: the last sets it back
// to 0); the same answer in every thread, and the other blocks' writes made before
// their count are visible to the last one (the fences). Also the tensor-core kernel's
// multi-block form (engine/backends/cuda/attention/decode_tc.py).

__device__ __forceinline__ bool mb_last_of(int* cnt, int n) {
  __shared__ bool last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const bool l = atomicAdd(cnt, 1) == n - 1;
    if (l) {
      *cnt = 0;
    }
    last = l;
  }
  __syncthreads();
  const bool mine = last;
  if (mine) {
    __threadfence();
  }
  return mine;
}
