// engine/backends/cuda/attention/prefill.py: _SOURCE

  constexpr int BQ = 64;
  constexpr int BK = 64;          // keys a tile
  constexpr int RS = HD + 8;      // shared row stride (elements): spreads the banks
  constexpr int NT = BK / 8;      // score n-tiles a warp
  constexpr int KS = HD / 16;     // k-steps of q.k
  constexpr int DT = HD / 8;      // output n-tiles
  constexpr int CH = HD / 8;      // 16-byte chunks a row
  constexpr int TILE = BK * RS;
  // STAGES tiles of K, then STAGES of V (dynamic shared memory)
  extern __shared__ __align__(16) unsigned char mb_smem[];
  T* const ks0 = reinterpret_cast<T*>(mb_smem);
  T* const vs0 = ks0 + STAGES * TILE;

  const int lq = q_shape[2];
  const int s_len = keys_shape[2];
  const int n_q = q_shape[1];
  const int hq = blockIdx.y;
  const int b = blockIdx.z;
  const int hkv = hq / (n_q / keys_shape[1]);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int g = lane / 4;
  const int tg = lane % 4;
  // the blocks with the most keys to see start first
  const int q0 = (gridDim.x - 1 - blockIdx.x) * BQ;
  const int diag = s_len - lq;  // query row r sees keys <= diag + r
  const int r_lo = q0 + warp * 16;
  const bool rows_here = r_lo < lq;
  const int w_last = diag + min(lq - 1, r_lo + 15);  // this warp's last key
  const int last_key = diag + min(lq - 1, q0 + BQ - 1);
  const int ntiles = last_key / BK + 1;

  const T* kb = keys + b * keys_strides[0] + hkv * keys_strides[1];
  const T* vb = values + b * values_strides[0] + hkv * values_strides[1];
  const int64_t kst = keys_strides[2];
  const int64_t vst = values_strides[2];

  // the warp's 16 rows (clamped inside the array) as A fragments for every k-step
  uint32_t qf[KS][4];
  {
    const T* qb = q + b * q_strides[0] + hq * q_strides[1];
    const T* pa = qb + min(r_lo + g, lq - 1) * q_strides[2] + tg * 2;
    const T* pb = qb + min(r_lo + g + 8, lq - 1) * q_strides[2] + tg * 2;
#pragma unroll
    for (int kk = 0; kk < KS; ++kk) {
      qf[kk][0] = *reinterpret_cast<const uint32_t*>(pa + kk * 16);
      qf[kk][1] = *reinterpret_cast<const uint32_t*>(pb + kk * 16);
      qf[kk][2] = *reinterpret_cast<const uint32_t*>(pa + kk * 16 + 8);
      qf[kk][3] = *reinterpret_cast<const uint32_t*>(pb + kk * 16 + 8);
    }
  }
  const float sl2 = scale[0] * 1.4426950408889634f;  // exp(x) = exp2(x * log2 e)
  float m0 = -INFINITY, m1 = -INFINITY;  // running max of rows g and g + 8 (log2 units)
  float l0 = 0.f, l1 = 0.f;              // this lane's share of their sums
  float o[DT][4];
#pragma unroll
  for (int d = 0; d < DT; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;

  // tile kt's K and V into stage st: cp.async (STAGES 2) or through registers
  auto load = [&](int kt, int st) {
    const int k0 = kt * BK;
    for (int i = threadIdx.x; i < BK * CH; i += blockDim.x) {
      const int r = i / CH, c = (i % CH) * 8;
      const bool in = k0 + r < s_len;
      const int64_t row = in ? k0 + r : 0;
      T* kd = ks0 + st * TILE + r * RS + c;
      T* vd = vs0 + st * TILE + r * RS + c;
      if constexpr (STAGES == 2) {
        mb_cp16z(kd, kb + row * kst + c, in);
        mb_cp16z(vd, vb + row * vst + c, in);
      } else {
        const uint4 z = make_uint4(0, 0, 0, 0);
        *reinterpret_cast<uint4*>(kd) = in ? *reinterpret_cast<const uint4*>(kb + row * kst + c) : z;
        *reinterpret_cast<uint4*>(vd) = in ? *reinterpret_cast<const uint4*>(vb + row * vst + c) : z;
      }
    }
  };
  if constexpr (STAGES == 2) {
    load(0, 0);
    mb_commit();
  }
  for (int kt = 0; kt < ntiles; ++kt) {
    const int k0 = kt * BK;
    const int st = STAGES == 2 ? kt & 1 : 0;
    if constexpr (STAGES == 2) {
      if (kt + 1 < ntiles) load(kt + 1, st ^ 1);  // its stage was freed by the last barrier
      mb_commit();
      mb_wait<1>();  // tile kt has landed
    } else {
      load(kt, 0);
    }
    __syncthreads();
    const T* ks = ks0 + st * TILE;
    const T* vs = vs0 + st * TILE;
    if (rows_here && k0 <= w_last) {
      float s[NT][4];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
        if constexpr (LDM) {
          // matrices: keys j*8.. x dims kk*16 + 0, 8, 16, 24: b0, b1 of k-steps kk, kk+1
          const T* kr = ks + (j * 8 + (lane & 7)) * RS + (lane >> 3) * 8;
#pragma unroll
          for (int kk = 0; kk < KS; kk += 2) {
            uint32_t r[4];
            mb_ldm4(r, kr + kk * 16);
            mb_mma(s[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], r[0], r[1], T{});
            mb_mma(s[j], qf[kk + 1][0], qf[kk + 1][1], qf[kk + 1][2], qf[kk + 1][3], r[2],
                   r[3], T{});
          }
        } else {
          const T* kr = ks + (j * 8 + g) * RS + tg * 2;
#pragma unroll
          for (int kk = 0; kk < KS; ++kk) {
            const uint32_t b0 = *reinterpret_cast<const uint32_t*>(kr + kk * 16);
            const uint32_t b1 = *reinterpret_cast<const uint32_t*>(kr + kk * 16 + 8);
            mb_mma(s[j], qf[kk][0], qf[kk][1], qf[kk][2], qf[kk][3], b0, b1, T{});
          }
        }
      }
      // scale (log2 units); the causal limit only where this tile crosses it
      const bool masked = k0 + BK - 1 > diag + r_lo;
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float v = s[j][e] * sl2;
          if (masked) {
            const int key = k0 + j * 8 + tg * 2 + (e & 1);
            const int row = r_lo + g + (e >> 1) * 8;
            if (key > min(diag + row, s_len - 1)) v = -INFINITY;
          }
          s[j][e] = v;
        }
        mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
        mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
      }
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
      mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      // key 0 is in every row's first tile, so the max is finite from there on
      const float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
      const float z0 = n0 == -INFINITY ? 0.f : n0, z1 = n1 == -INFINITY ? 0.f : n1;
      const float a0 = exp2f(m0 - z0), a1 = exp2f(m1 - z1);
      m0 = n0;
      m1 = n1;
      l0 *= a0;
      l1 *= a1;
#pragma unroll
      for (int d = 0; d < DT; ++d) {
        o[d][0] *= a0;
        o[d][1] *= a0;
        o[d][2] *= a1;
        o[d][3] *= a1;
      }
      uint32_t pf[NT][2];
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        const float p0 = exp2f(s[j][0] - z0), p1 = exp2f(s[j][1] - z0);
        const float p2 = exp2f(s[j][2] - z1), p3 = exp2f(s[j][3] - z1);
        l0 += p0 + p1;
        l1 += p2 + p3;
        pf[j][0] = mb_pack2(p0, p1, T{});
        pf[j][1] = mb_pack2(p2, p3, T{});
      }
      // o += p v: the score tiles 2kk, 2kk + 1 are the A fragment of k-step kk
#pragma unroll
      for (int kk = 0; kk < BK / 16; ++kk) {
        const uint32_t pa0 = pf[2 * kk][0], pa1 = pf[2 * kk][1];
        const uint32_t pa2 = pf[2 * kk + 1][0], pa3 = pf[2 * kk + 1][1];
        if constexpr (LDM) {
          // transposed matrices: keys kk*16 + 0, 8 x dims d*8, (d+1)*8: b0, b1 of d, d+1
          const T* vr = vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * RS + (lane >> 4) * 8;
#pragma unroll
          for (int d = 0; d < DT; d += 2) {
            uint32_t r[4];
            mb_ldm4t(r, vr + d * 8);
            mb_mma(o[d], pa0, pa1, pa2, pa3, r[0], r[1], T{});
            mb_mma(o[d + 1], pa0, pa1, pa2, pa3, r[2], r[3], T{});
          }
        } else {
          const T* vr = vs + (kk * 16 + tg * 2) * RS + g;
#pragma unroll
          for (int d = 0; d < DT; ++d) {
            const uint32_t b0 = mb_join2<T>(vr[d * 8], vr[d * 8 + RS]);
            const uint32_t b1 = mb_join2<T>(vr[d * 8 + 8 * RS], vr[d * 8 + 9 * RS]);
            mb_mma(o[d], pa0, pa1, pa2, pa3, b0, b1, T{});
          }
        }
      }
    }
    __syncthreads();  // every warp is done with this stage
  }
  if (!rows_here) return;
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
  const float i0 = 1.f / l0, i1 = 1.f / l1;
  const int ra = r_lo + g, rb = r_lo + g + 8;
  T* ob = out + (static_cast<int64_t>(b) * n_q + hq) * lq * HD + tg * 2;
#pragma unroll
  for (int d = 0; d < DT; ++d) {
    if (ra < lq)
      *reinterpret_cast<uint32_t*>(ob + ra * HD + d * 8) = mb_pack2(o[d][0] * i0, o[d][1] * i0, T{});
    if (rb < lq)
      *reinterpret_cast<uint32_t*>(ob + rb * HD + d * 8) = mb_pack2(o[d][2] * i1, o[d][3] * i1, T{});
  }
