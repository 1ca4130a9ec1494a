// engine/backends/cuda/products/gemv.py: _Q4_LOOP

  const int64_t words = K / 8;
  const int64_t groups = K / GS;
  const int chunks = K / 32;
  for (int c = lane; c < chunks; c += 32) {
    const int k0 = c * 32;
    const int g = k0 / GS;
    uint4 wq[R];
    float sc[R];
    float bs[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int64_t n = n0 + r;
      wq[r] = reinterpret_cast<const uint4*>(w + n * words)[c];
      sc[r] = static_cast<float>(scales[n * groups + g]);
      bs[r] = static_cast<float>(biases[n * groups + g]);
    }
    float d[MMAX][R];
    float xs[MMAX];
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
      xs[m] = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        d[m][r] = 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float qf[R][8];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t word = j == 0 ? wq[r].x : j == 1 ? wq[r].y : j == 2 ? wq[r].z : wq[r].w;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          qf[r][i] = __uint_as_float(0x4B000000u | ((word >> (4 * i)) & 0xFu)) - 8388608.f;
        }
      }
#pragma unroll
      for (int m = 0; m < MMAX; ++m) {
        if (m < M) {
          const uint4 xu = reinterpret_cast<const uint4*>(x + (int64_t)m * K + k0)[j];
          float xv[8];
          mb_to_float8(xu, xv, T{});
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            xs[m] += xv[i];
#pragma unroll
            for (int r = 0; r < R; ++r) {
              d[m][r] += xv[i] * qf[r][i];
            }
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        acc[m][r] += sc[r] * d[m][r] + bs[r] * xs[m];
      }
    }
  }
