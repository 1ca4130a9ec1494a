// engine/backends/cuda/prefetch.py: _BODY

  const size_t t = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const size_t nt = static_cast<size_t>(gridDim.x) * blockDim.x;
  if (blockIdx.x == 0) {  // the layer's input, for o_proj's residual
    const int d = r_shape[1];
    for (int i = threadIdx.x; i < d; i += blockDim.x) {
      out[i] = r[i];
    }
  }
  // o_proj: all of it
  mb_pf_l2(wo, static_cast<size_t>(wo_shape[0]) * wo_shape[1] * 4, t, nt);
  mb_pf_l2(so, static_cast<size_t>(so_shape[0]) * so_shape[1] * sizeof(T), t, nt);
  mb_pf_l2(bo, static_cast<size_t>(bo_shape[0]) * bo_shape[1] * sizeof(T), t, nt);
  // gate/up ([gate; up] rows): the first ROWS of each half, the rows its kernel's warps
  // take first (engine/backends/cuda/products/qstream.py: warp g takes output g, then g + all warps, ...)
  const size_t n = static_cast<size_t>(wgu_shape[0]) / 2;
  const size_t rows = ROWS < n ? static_cast<size_t>(ROWS) : n;
  const size_t wr = static_cast<size_t>(wgu_shape[1]) * 4;
  const size_t sr = static_cast<size_t>(sgu_shape[1]) * sizeof(T);
  const char* w = reinterpret_cast<const char*>(wgu);
  const char* s = reinterpret_cast<const char*>(sgu);
  const char* b = reinterpret_cast<const char*>(bgu);
  mb_pf_l2(w, rows * wr, t, nt);
  mb_pf_l2(w + n * wr, rows * wr, t, nt);
  mb_pf_l2(s, rows * sr, t, nt);
  mb_pf_l2(s + n * sr, rows * sr, t, nt);
  mb_pf_l2(b, rows * sr, t, nt);
  mb_pf_l2(b + n * sr, rows * sr, t, nt);
  (void)dep;
