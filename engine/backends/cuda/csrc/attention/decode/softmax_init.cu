// engine/backends/cuda/attention/decode.py: _SOFTMAX_INIT

  float m[G];
  float l[G];
  float acc[G][PER];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      acc[g][i] = 0.f;
    }
  }

