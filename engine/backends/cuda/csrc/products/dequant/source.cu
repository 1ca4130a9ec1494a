// engine/backends/cuda/products/dequant.py: _SOURCE

  const int64_t nw = static_cast<int64_t>(w_shape[0]) * w_shape[1];  // words
  const int lane = threadIdx.x & 31;
  const int64_t base = ((static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5) * 128;
  uint32_t v[4], s2[4], b2[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t c = base + j * 32 + lane;  // word c: weights 8c..8c+7 of the flat [N, K]
    v[j] = 0;
    s2[j] = 0;
    b2[j] = 0;
    if (c < nw) {
      const int64_t gi = c * 8 / GS;  // scales [N, K / GS] flat: the same index
      v[j] = w[c];
      s2[j] = mb_dup(scales[gi]);
      b2[j] = mb_dup(biases[gi]);
    }
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int64_t c = base + j * 32 + lane;
    if (c < nw) {
      uint4 o;
      o.x = mb_dq2(v[j], s2[j], b2[j], T{});
      o.y = mb_dq2(v[j] >> 8, s2[j], b2[j], T{});
      o.z = mb_dq2(v[j] >> 16, s2[j], b2[j], T{});
      o.w = mb_dq2(v[j] >> 24, s2[j], b2[j], T{});
      reinterpret_cast<uint4*>(y)[c] = o;
    }
  }
