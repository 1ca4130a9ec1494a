// engine/backends/cuda/attention/decode.py: _Q_LOAD
// q as the decode step hands it (RoPE'd, [B, Hq, 1, D]); every position from the cache

  const int t_end = t1;
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const T* qp = q + b * q_strides[0] + (hkv * G + g) * q_strides[1] + sl * PER;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      qr[g][i] = static_cast<float>(qp[i]) * MB_SCALE;
    }
  }
