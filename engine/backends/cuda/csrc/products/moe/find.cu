// the block's expert (the slot-th present one) and its pairs; then the warp's rows
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int P = idx_shape[0];
  const int N = w_shape[1];
  const int K = x_shape[1];
  const int tiles = (N + WARPS * R - 1) / (WARPS * R);
  const int slot = blockIdx.x / tiles;
  const int tile = blockIdx.x - slot * tiles;
  __shared__ uint32_t present[32];
  __shared__ int pairs[LCAP];
  __shared__ int count;
  __shared__ int expert;
  if (threadIdx.x < 32) {
    present[threadIdx.x] = 0u;
  }
  if (threadIdx.x == 0) {
    count = 0;
  }
  __syncthreads();
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    const uint32_t e = idx[p];
    atomicOr(&present[e >> 5], 1u << (e & 31u));
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int s = slot;
    int found = -1;
    for (int i = 0; i < 32 && found < 0; ++i) {
      uint32_t bits = present[i];
      const int c = __popc(bits);
      if (s < c) {
        for (int j = 0; j < s; ++j) {
          bits &= bits - 1u;
        }
        found = i * 32 + __ffs(bits) - 1;
      } else {
        s -= c;
      }
    }
    expert = found;
  }
  __syncthreads();
  const int e = expert;
  if (e < 0) {
    return;
  }
  for (int p = threadIdx.x; p < P; p += blockDim.x) {
    if (idx[p] == static_cast<uint32_t>(e)) {
      const int i = atomicAdd(&count, 1);
      if (i < LCAP) {
        pairs[i] = p;
      }
    }
  }
  __syncthreads();
  const int n_pairs = min(count, LCAP);
  const int n0 = (tile * WARPS + warp) * R;
  if (n0 >= N) {
    return;
  }
  const int64_t words = K / 8;
  const int groups = K / GS;
  const int chunks = K / 32;
  const int64_t wbase = static_cast<int64_t>(e) * N * words;
  const int64_t sbase = static_cast<int64_t>(e) * N * groups;
