// engine/backends/cuda/products/gemv.py: _F_LOOP

  const int chunks = K / 8;
#pragma unroll 2
  for (int c = lane; c < chunks; c += 32) {
    float wf[R][8];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4 wu = reinterpret_cast<const uint4*>(w + (int64_t)(n0 + r) * K)[c];
      mb_to_float8(wu, wf[r], T{});
    }
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
      if (m < M) {
        const uint4 xu = reinterpret_cast<const uint4*>(x + (int64_t)m * K)[c];
        float xv[8];
        mb_to_float8(xu, xv, T{});
#pragma unroll
        for (int i = 0; i < 8; ++i) {
#pragma unroll
          for (int r = 0; r < R; ++r) {
            acc[m][r] += xv[i] * wf[r][i];
          }
        }
      }
    }
  }
