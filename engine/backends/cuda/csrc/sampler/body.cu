// engine/backends/cuda/sampler.py: _BODY

  constexpr int NW = NT / 32;
  __shared__ float mass[MAXB];
  __shared__ float red_v[NW];
  __shared__ int red_i[NW];
  __shared__ int pick;
  const int row = blockIdx.x;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int v = x_shape[1];
  const int nb = (v + BLK - 1) / BLK;
  const T* xr = x + static_cast<size_t>(row) * v;
  const float inv_t = p[row * 4 + 0];
  const float u0 = p[row * 4 + 1];
  const float u1 = p[row * 4 + 2];

  // 1. the row's max and its first index
  float m = -INFINITY;
  int mi = 0;  // a row of -inf only: token 0, as mx.argmax
  for (int i = threadIdx.x; i < v; i += NT) {
    mb_argmax_merge(m, mi, static_cast<float>(xr[i]), i);
  }
  for (int o = 16; o > 0; o >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, o);
    const int i2 = __shfl_xor_sync(0xffffffffu, mi, o);
    mb_argmax_merge(m, mi, m2, i2);
  }
  if (lane == 0) {
    red_v[warp] = m;
    red_i[warp] = mi;
  }
  __syncthreads();
  m = red_v[0];
  mi = red_i[0];
  for (int w = 1; w < NW; ++w) mb_argmax_merge(m, mi, red_v[w], red_i[w]);
  if (inv_t <= 0.0f) {  // greedy (block-uniform)
    if (threadIdx.x == 0) out[row * 4] = mi;
    return;
  }

  // 2. each block's mass against the row's max: warp w takes blocks w, w + NW, ...
  for (int b = warp; b < nb; b += NW) {
    float s = 0.0f;
    for (int k = lane; k < BLK; k += 32) {
      const int i = b * BLK + k;
      if (i < v) s += __expf((static_cast<float>(xr[i]) - m) * inv_t);
    }
    s = mb_warp_sum(s);
    if (lane == 0) mass[b] = s;
  }
  __syncthreads();

  // 3. warp 0: the first block whose running mass reaches u0 of the total
  if (warp == 0) {
    float t = 0.0f;
    int last = 0;  // the last block with mass (a fallback past rounding)
    for (int b = lane; b < nb; b += 32) {
      t += mass[b];
      if (mass[b] > 0.0f) last = b;
    }
    t = mb_warp_sum(t);
    for (int o = 16; o > 0; o >>= 1) last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
    const float target = u0 * t;
    float carry = 0.0f;
    int found = last;
    for (int b0 = 0; b0 < nb; b0 += 32) {
      const int b = b0 + lane;
      const float mb = b < nb ? mass[b] : 0.0f;
      const float c = mb_warp_scan(mb, lane) + carry;
      const unsigned hit = __ballot_sync(0xffffffffu, b < nb && mb > 0.0f && c >= target);
      if (hit) {
        found = b0 + __ffs(hit) - 1;
        break;
      }
      carry = __shfl_sync(0xffffffffu, c, 31);
    }
    if (lane == 0) pick = found;
  }
  __syncthreads();

  // 4. warp 0: the token in that block, 8 consecutive tokens a lane
  if (warp == 0) {
    const int base = pick * BLK + lane * (BLK / 32);
    float e[BLK / 32];
    float s = 0.0f;
    int last = -1;  // this lane's last token with weight
    for (int j = 0; j < BLK / 32; ++j) {
      const int i = base + j;
      e[j] = i < v ? __expf((static_cast<float>(xr[i]) - m) * inv_t) : 0.0f;
      s += e[j];
      if (e[j] > 0.0f) last = j;
    }
    const float c = mb_warp_scan(s, lane);
    const float target = u1 * __shfl_sync(0xffffffffu, c, 31);
    const unsigned hit = __ballot_sync(0xffffffffu, s > 0.0f && c >= target);
    const unsigned any = __ballot_sync(0xffffffffu, s > 0.0f);
    // the lane where the running mass crosses the target, else the last lane with mass
    const int l = hit ? __ffs(hit) - 1 : (any ? 31 - __clz(any) : 0);
    if (lane == l) {
      float run = c - s;
      int pos = last;
      for (int j = 0; j < BLK / 32; ++j) {
        run += e[j];
        if (e[j] > 0.0f && run >= target) {
          pos = j;
          break;
        }
      }
      out[row * 4] = base + max(pos, 0);
    }
  }
