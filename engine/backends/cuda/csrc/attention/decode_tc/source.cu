// engine/backends/cuda/attention/decode_tc.py: _SOURCE

  constexpr int RS = HD + 8;   // shared row stride (elements): ldmatrix rows on 8 banks
  constexpr int NT = BK / 8;   // score n-tiles (8 keys each) a tile
  constexpr int KS = HD / 16;  // k-steps of q.k
  constexpr int DT = HD / 8;   // output n-tiles
  constexpr int CH = HD / 8;   // 16-byte chunks a row
  constexpr int TILE = BK * RS;
  // a warp's elements: K, V x STG stages, q, k, v, then the RoPE's cos/sin (HD floats)
  constexpr int WSM = 2 * STG * TILE + (G + 4) * HD;
  extern __shared__ __align__(16) unsigned char mb_smem[];
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int tg = lane % 4;
  const int n_kv = keys_shape[1];
  // (row, KV head) of this warp; SPLIT: of the block, whose warps share its tiles
  constexpr int nb = 1;
  constexpr int part = 0;
  const int unit = SPLIT ? blockIdx.x : blockIdx.x * WARPS + warp;
  if (unit >= qkv_shape[0] * n_kv) {
    return;  // the whole warp (never with SPLIT: the grid is exact there)
  }
  const int b = unit / n_kv;
  const int hkv = unit % n_kv;
  T* const ks0 = reinterpret_cast<T*>(mb_smem) + warp * WSM;
  T* const vs0 = ks0 + STG * TILE;
  T* const qsm = vs0 + STG * TILE;  // [G][HD] the query heads, RoPE'd
  T* const kn = qsm + G * HD;     // [HD] the new k, RoPE'd
  T* const vn = kn + HD;          // [HD] the new v
  float* const rcos = reinterpret_cast<float*>(vn + HD);  // [HD/2] per frequency
  float* const rsin = rcos + HD / 2;
  // every qkv value this lane's RoPE needs, read first: the reads then overlap each
  // other and start/pos's. Why: written as loads inside the loop that stores into
  // qsm, each waited for the store before it (generic pointers may alias): one L2
  // round trip an element, ~4 us of one row's ~11 us call (the measured ablation)
  const T* xb = qkv + b * qkv_strides[0];
  const int nq = n_kv * G * HD;
  constexpr int QPL = G * HD / 32;  // query elements a lane (i = lane + 32 j)
  constexpr int KPL = HD / 32;      // new k (and v) elements a lane (d = lane + 32 j)
  auto partner = [](int d) { return TRAD ? d ^ 1 : (d < HD / 2 ? d + HD / 2 : d - HD / 2); };
  T qx[QPL], qp[QPL], kx[KPL], kp[KPL], vx[KPL];
#pragma unroll
  for (int j = 0; j < QPL; ++j) {
    const int i = lane + 32 * j;
    const T* src = xb + (hkv * G + i / HD) * HD;
    qx[j] = src[i % HD];
    qp[j] = src[partner(i % HD)];
  }
#pragma unroll
  for (int j = 0; j < KPL; ++j) {
    const int d = lane + 32 * j;
    kx[j] = xb[nq + hkv * HD + d];
    kp[j] = xb[nq + hkv * HD + partner(d)];
    vx[j] = xb[nq + n_kv * HD + hkv * HD + d];
  }
  const int row0 = start[b];
  const int t_len = TPOS ? pos[b] + row0 + 1 : keys_shape[2];
  const int t_new = t_len - 1;
  T* const kb = const_cast<T*>(keys) + b * keys_strides[0] + hkv * keys_strides[1];
  T* const vb = const_cast<T*>(values) + b * values_strides[0] + hkv * values_strides[1];
  const int64_t kst = keys_strides[2];
  const int64_t vst = values_strides[2];

  // tile kt's keys [k0, k0 + BK) into stage st, keys past the end as zeros; not the new
  // slot, which the tile takes from the warp's copy once it has landed (patched below)
  const int ntiles = (t_len - row0 + BK - 1) / BK;
  const int tpp = (ntiles + nb - 1) / nb;        // tiles a part
  const int kt_hi = min(ntiles, (part + 1) * tpp);  // this block's tiles: [part * tpp, kt_hi)
  auto load = [&](int kt, int st) {
    const int k0 = row0 + kt * BK;
#pragma unroll
    for (int i = lane; i < BK * CH; i += 32) {
      const int r = i / CH;
      const int c = (i % CH) * 8;
      const int key = k0 + r;
      if (key != t_new) {
        const bool in = key < t_len;
        const int64_t row = in ? key : 0;
        mb_cp16z(ks0 + st * TILE + r * RS + c, kb + row * kst + c, in);
        mb_cp16z(vs0 + st * TILE + r * RS + c, vb + row * vst + c, in);
      }
    }
  };
  // the warp's first STG - 1 tiles are on their way while the RoPE below is computed
  const int kstep = SPLIT ? WARPS : 1;  // SPLIT: warp w takes tiles w, w + WARPS, ...
  int kt = SPLIT ? part * tpp + warp : 0;
#pragma unroll
  for (int s0 = 0; s0 < STG - 1; ++s0) {
    if (kt + s0 * kstep < kt_hi) {
      load(kt + s0 * kstep, s0);
    }
    mb_commit();
  }

  // RoPE as engine/backends/cuda/attention/decode.py's append form: angle = scale * position * inv_freq,
  // pairs (d, d + HD/2), or (2i, 2i + 1) when TRAD; the result rounded to T
  const float pos_f = MB_ROPE_SCALE * static_cast<float>(pos[b]);
  // one sincos a frequency (HD/2 of them), not one an element: G + 1 heads share them
  // (20 a lane at 8b: ~1.7 us of one row's call)
  for (int f = lane; f < HD / 2; f += 32) {
    sincosf(pos_f * inv_freq[f], &rsin[f], &rcos[f]);
  }
  __syncwarp();
  auto rope = [&](T xt, T pt, int d) -> T {
    const int f = TRAD ? d / 2 : d % (HD / 2);
    const float c = rcos[f];
    const float s = rsin[f];
    const float x = static_cast<float>(xt);
    const float p = static_cast<float>(pt);
    const bool first = TRAD ? !(d & 1) : d < HD / 2;
    return static_cast<T>(first ? x * c - p * s : p * s + x * c);
  };
#pragma unroll
  for (int j = 0; j < QPL; ++j) {
    const int i = lane + 32 * j;
    qsm[i] = rope(qx[j], qp[j], i % HD);
  }
#pragma unroll
  for (int j = 0; j < KPL; ++j) {
    const int d = lane + 32 * j;
    const T kv = rope(kx[j], kp[j], d);
    kn[d] = kv;
    vn[d] = vx[j];
    if (!SPLIT || (warp == 0 && part == 0)) {
      kb[t_new * kst + d] = kv;  // the cache's new slot (no lane of this kernel reads it)
      vb[t_new * vst + d] = vx[j];
    }
  }
  __syncwarp();

  // the query heads as A fragments of every k-step: rows g < G, rows g + 8 zero
  uint32_t qf[KS][2];
#pragma unroll
  for (int kk = 0; kk < KS; ++kk) {
    const T* qr = qsm + min(g, G - 1) * HD + kk * 16 + tg * 2;
    qf[kk][0] = g < G ? *reinterpret_cast<const uint32_t*>(qr) : 0u;
    qf[kk][1] = g < G ? *reinterpret_cast<const uint32_t*>(qr + 8) : 0u;
  }
  const float sl2 = MB_SCALE * 1.4426950408889634f;  // exp(x) = exp2(x * log2 e)
  float m0 = -INFINITY;  // running max of head g (log2 units)
  float l0 = 0.f;        // this lane's share of its sum
  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; ++d) {
    o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  }

  for (int it = 0; kt < kt_hi; kt += kstep, ++it) {
    const int k0 = row0 + kt * BK;
    const int st = it % STG;
    if (kt + (STG - 1) * kstep < kt_hi) {
      // STG - 1 tiles ahead, into the stage the last __syncwarp freed
      load(kt + (STG - 1) * kstep, (it + STG - 1) % STG);
    }
    mb_commit();
    mb_wait<STG - 1>();  // tile kt's copies (this lane's) have landed
    __syncwarp();  // and every lane's
    T* const ks = ks0 + st * TILE;
    T* const vs = vs0 + st * TILE;
    if (t_new - k0 < BK) {  // the tile holds the new slot (warp-uniform): from the copy
      const int r = t_new - k0;
      for (int c = lane; c < CH; c += 32) {
        reinterpret_cast<uint4*>(ks + r * RS)[c] = reinterpret_cast<const uint4*>(kn)[c];
        reinterpret_cast<uint4*>(vs + r * RS)[c] = reinterpret_cast<const uint4*>(vn)[c];
      }
      __syncwarp();
    }
    float s[NT][4];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
      // matrices: keys j*8.. x dims kk*16 + 0, 8, 16, 24: b0, b1 of k-steps kk, kk+1
      const T* kr = ks + (j * 8 + (lane & 7)) * RS + (lane >> 3) * 8;
#pragma unroll
      for (int kk = 0; kk < KS; kk += 2) {
        uint32_t r[4];
        mb_ldm4(r, kr + kk * 16);
        mb_mma(s[j], qf[kk][0], 0u, qf[kk][1], 0u, r[0], r[1], T{});
        mb_mma(s[j], qf[kk + 1][0], 0u, qf[kk + 1][1], 0u, r[2], r[3], T{});
      }
    }
    // head g's scores (s[j][0..1]: keys k0 + j*8 + 2tg, +1), past the end -inf
    float mx0 = -INFINITY;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = k0 + j * 8 + tg * 2 + e;
        const float v = key < t_len ? s[j][e] * sl2 : -INFINITY;
        s[j][e] = v;
        mx0 = fmaxf(mx0, v);
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    const float n0 = fmaxf(m0, mx0);  // finite: key k0 < t_len is in every tile
    const float a0 = exp2f(m0 - n0);
    m0 = n0;
    l0 *= a0;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      o[d][0] *= a0;
      o[d][1] *= a0;
    }
    uint32_t pf[NT];
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      const float p0 = exp2f(s[j][0] - n0);
      const float p1 = exp2f(s[j][1] - n0);
      l0 += p0 + p1;
      pf[j] = mb_pack2(p0, p1, T{});
    }
    // o += p v: score n-tiles 2kk, 2kk + 1 are the A fragment of k-step kk (rows g + 8
    // zero)
#pragma unroll
    for (int kk = 0; kk < BK / 16; ++kk) {
      const uint32_t pa0 = pf[2 * kk];
      const uint32_t pa2 = pf[2 * kk + 1];
      // transposed matrices: keys kk*16 + 0, 8 x dims d*8, (d+1)*8: b0, b1 of d, d+1
      const T* vr = vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * RS + (lane >> 4) * 8;
#pragma unroll
      for (int d = 0; d < DT; d += 2) {
        uint32_t r[4];
        mb_ldm4t(r, vr + d * 8);
        mb_mma(o[d], pa0, 0u, pa2, 0u, r[0], r[1], T{});
        mb_mma(o[d + 1], pa0, 0u, pa2, 0u, r[2], r[3], T{});
      }
    }
    __syncwarp();  // every lane is done with this stage
  }
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  T* const ob = out + (static_cast<int64_t>(b) * n_kv + hkv) * G * HD;
  if constexpr (SPLIT) {
    // the warps' softmaxes merged through shared memory (the stages are free now); a
    // warp without tiles has m -inf and adds nothing; warp 0 always has tile 0
    __syncthreads();
    float* const sm_m = reinterpret_cast<float*>(mb_smem);  // [WARPS][8]
    float* const sm_l = sm_m + WARPS * 8;                   // [WARPS][8]
    float* const sm_o = sm_l + WARPS * 8;                   // [WARPS][G][HD]
    if (tg == 0) {
      sm_m[warp * 8 + g] = m0;
      sm_l[warp * 8 + g] = l0;
    }
    if (g < G) {
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        sm_o[(warp * G + g) * HD + d * 8 + tg * 2] = o[d][0];
        sm_o[(warp * G + g) * HD + d * 8 + tg * 2 + 1] = o[d][1];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < G * HD; i += WARPS * 32) {
      const int gg = i / HD;
      float M = -INFINITY;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        M = fmaxf(M, sm_m[w * 8 + gg]);
      }
      float L = 0.f;
      float A = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float mw = sm_m[w * 8 + gg];
        if (mw != -INFINITY) {
          const float e = exp2f(mw - M);
          L += sm_l[w * 8 + gg] * e;
          A += sm_o[w * G * HD + i] * e;
        }
      }
      ob[i] = static_cast<T>(A / L);
    }
  } else if (g < G) {
    const float i0 = 1.f / l0;
#pragma unroll
    for (int d = 0; d < DT; ++d) {
      *reinterpret_cast<uint32_t*>(ob + g * HD + d * 8 + tg * 2) =
          mb_pack2(o[d][0] * i0, o[d][1] * i0, T{});
    }
  }
