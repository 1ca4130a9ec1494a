// engine/backends/cuda/products/mma.py: _HEAD
// both kernels: lane roles, the accumulators c[n-tile][4], and at the end the warps'
// partial sums added through shared memory and written as y[m, n]

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int K = x_shape[1];
  const int NW = w_shape[0];
  // GLU: w is [gate; up] (NW/2 rows each); an m-tile takes 8 gate rows (MMA rows 0-7)
  // and the 8 matching up rows (8-15), and writes silu(gate) * up: NW/2 outputs
  const int N = GLU ? NW / 2 : NW;
  // a block takes up to 32 rows of x: chunk blockIdx.x % RC, so that the chunks of one
  // weight tile run side by side (the tile comes from HBM once, from L2 for the rest)
  const int RC = (x_shape[0] + 31) / 32;
  const int m0 = (blockIdx.x % RC) * 32;
  const int M = min(x_shape[0] - m0, 32);
  x += (int64_t)m0 * K;
  y += (int64_t)m0 * N;
  if constexpr (RES) {
    r += (int64_t)m0 * N;
  }
  // a block owns MT m-tiles of 16 weight rows: 16 * MT output features (GLU: 8 * MT)
  const int n0 = (blockIdx.x / RC) * (GLU ? 8 : 16) * MT;  // the block's first feature
  int row0[MT], row1[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    const int f = n0 + i * (GLU ? 8 : 16) + g;
    row0[i] = f;
    row1[i] = GLU ? N + f : f + 8;
  }
  float c[MT][NT][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c[i][j][e] = 0.f;
      }
    }
  }
  const T* xr[NT];
  bool xv[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int m = j * 8 + g;
    xv[j] = m < M;
    xr[j] = x + (int64_t)(xv[j] ? m : 0) * K;
  }
  const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
