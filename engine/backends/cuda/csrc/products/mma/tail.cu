// engine/backends/cuda/products/mma.py: _TAIL

  // one m-tile at a time through shared memory (all MT at once would need up to
  // 64 KB): the warps' partial sums added, the epilogue applied, y written
  __shared__ float red[WARPS * NT * 128];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    if (mt > 0) {
      __syncthreads();  // the previous m-tile's reads of red are done
    }
    const int nb = n0 + mt * (GLU ? 8 : 16);  // this m-tile's first output feature
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        red[((warp * NT + j) * 4 + i) * 32 + lane] = c[mt][j][i];
      }
    }
    __syncthreads();
    if constexpr (GLU) {
      // lane l's c[j][i] (i < 2) is gate feature nb + l/4, c[j][i + 2] the same up feature
      for (int e = threadIdx.x; e < NT * 64; e += WARPS * 32) {
        const int j = e >> 6;
        const int i = (e >> 5) & 1;
        const int l = e & 31;
        float gs = 0.f, us = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < WARPS; ++w2) {
          gs += red[w2 * NT * 128 + (j * 4 + i) * 32 + l];
          us += red[w2 * NT * 128 + (j * 4 + i + 2) * 32 + l];
        }
        const int m = j * 8 + (l & 3) * 2 + i;
        if (m < M) {
          y[(int64_t)m * N + nb + (l >> 2)] = static_cast<T>(gs / (1.f + __expf(-gs)) * us);
        }
      }
    } else {
      for (int e = threadIdx.x; e < NT * 128; e += WARPS * 32) {
        float v = 0.f;
#pragma unroll
        for (int w2 = 0; w2 < WARPS; ++w2) {
          v += red[w2 * NT * 128 + e];
        }
        const int j = e >> 7;
        const int i = (e >> 5) & 3;
        const int l = e & 31;
        const int n = nb + (l >> 2) + (i >= 2 ? 8 : 0);
        const int m = j * 8 + (l & 3) * 2 + (i & 1);
        if (m < M) {
          if constexpr (RES) {
            v += static_cast<float>(r[(int64_t)m * N + n]);
          }
          y[(int64_t)m * N + n] = static_cast<T>(v);
        }
      }
    }
  }
