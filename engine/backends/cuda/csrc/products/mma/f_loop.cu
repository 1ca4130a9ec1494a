// engine/backends/cuda/products/mma.py: _F_LOOP
// float weights [N, K]: a lane's 16-byte slice is 8 inputs, two MMA steps

  const T* w0[MT];
  const T* w1[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    w0[i] = w + (int64_t)row0[i] * K;
    w1[i] = w + (int64_t)row1[i] * K;
  }
  const int chunks = K / 8;
  for (int s = warp; s * 4 * U < chunks; s += WARPS) {
    uint4 a0[MT][U], a1[MT][U], b[NT][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t off = (int64_t)((s * U + u) * 4 + t) * 8;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        a0[i][u] = mb_ldg(w0[i] + off);
        a1[i][u] = mb_ldg(w1[i] + off);
      }
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        b[j][u] = xv[j] ? mb_ldg(xr[j] + off) : zero;
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
          mb_mma(c[i][j], a0[i][u].x, a1[i][u].x, a0[i][u].y, a1[i][u].y, b[j][u].x, b[j][u].y,
                 T{});
          mb_mma(c[i][j], a0[i][u].z, a1[i][u].z, a0[i][u].w, a1[i][u].w, b[j][u].z, b[j][u].w,
                 T{});
        }
      }
    }
  }
