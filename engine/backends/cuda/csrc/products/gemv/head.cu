// engine/backends/cuda/products/gemv.py: _HEAD
// shared by both kernels: the warp's R weight rows, acc[m][r] over the rows of x, and
// at the end a warp sum per (m, r) written by lane 0

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int N = w_shape[0];
  const int n0 = (blockIdx.x * WARPS + warp) * R;
  if (n0 >= N) {
    return;
  }
  float acc[MMAX][R];
#pragma unroll
  for (int m = 0; m < MMAX; ++m) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      acc[m][r] = 0.f;
    }
  }
