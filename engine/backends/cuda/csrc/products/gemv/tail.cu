// engine/backends/cuda/products/gemv.py: _TAIL

#pragma unroll
  for (int m = 0; m < MMAX; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        v += __shfl_xor_sync(0xffffffff, v, off);
      }
      if (lane == 0 && m < M) {
        y[(int64_t)m * N + n0 + r] = static_cast<T>(v);
      }
    }
  }
