// engine/backends/cuda/attention/decode.py: _MERGE

  __shared__ float sm_m[WARPS][G];
  __shared__ float sm_l[WARPS][G];
  __shared__ float sm_acc[WARPS][G][HD];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (lane == 0) {
      sm_m[warp][g] = m[g];
      sm_l[warp][g] = l[g];
    }
    if (sub == 0) {
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        sm_acc[warp][g][sl * PER + i] = acc[g][i];
      }
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * HD; idx += WARPS * 32) {
    const int g = idx / HD;
    const int d = idx % HD;
    float M = -INFINITY;
    for (int w = 0; w < WARPS; ++w) {
      M = fmaxf(M, sm_m[w][g]);
    }
    float L = 0.f;
    float A = 0.f;
    if (M != -INFINITY) {
      for (int w = 0; w < WARPS; ++w) {
        const float e = expf(sm_m[w][g] - M);
        L += sm_l[w][g] * e;
        A += sm_acc[w][g][d] * e;
      }
    }
    const int64_t row = static_cast<int64_t>(b) * n_kv * G + hkv * G + g;
