// engine/backends/cuda/products/mma.py: _Q4_LOOP
// 4-bit weights [N, K/8] uint32: a lane's 16-byte slice is 32 inputs (one quantization
// group's part), eight MMA steps; x's matching 32 inputs are four 16-byte loads

  const int words = K / 8;
  const int groups = K / GS;
  const uint32_t* w0[MT];
  const uint32_t* w1[MT];
  const T* s0[MT];
  const T* s1[MT];
  const T* b0p[MT];
  const T* b1p[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    w0[i] = w + (int64_t)row0[i] * words;
    w1[i] = w + (int64_t)row1[i] * words;
    s0[i] = scales + (int64_t)row0[i] * groups;
    s1[i] = scales + (int64_t)row1[i] * groups;
    b0p[i] = biases + (int64_t)row0[i] * groups;
    b1p[i] = biases + (int64_t)row1[i] * groups;
  }
  const int chunks = K / 32;
  for (int s = warp; s * 4 * U < chunks; s += WARPS) {
    uint4 q0[MT][U], q1[MT][U], b[NT][U][4];
    uint32_t sc0[MT][U], sc1[MT][U], bi0[MT][U], bi1[MT][U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ch = (s * U + u) * 4 + t;
      const int gi = ch * 32 / GS;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        q0[i][u] = mb_ldg(w0[i] + (int64_t)ch * 4);
        q1[i][u] = mb_ldg(w1[i] + (int64_t)ch * 4);
        const T sv0 = s0[i][gi], sv1 = s1[i][gi], bv0 = b0p[i][gi], bv1 = b1p[i][gi];
        const uint16_t hs0 = *reinterpret_cast<const uint16_t*>(&sv0);
        const uint16_t hs1 = *reinterpret_cast<const uint16_t*>(&sv1);
        const uint16_t hb0 = *reinterpret_cast<const uint16_t*>(&bv0);
        const uint16_t hb1 = *reinterpret_cast<const uint16_t*>(&bv1);
        sc0[i][u] = hs0 | ((uint32_t)hs0 << 16);
        sc1[i][u] = hs1 | ((uint32_t)hs1 << 16);
        bi0[i][u] = hb0 | ((uint32_t)hb0 << 16);
        bi1[i][u] = hb1 | ((uint32_t)hb1 << 16);
      }
      if constexpr (!XL) {
#pragma unroll
        for (int j = 0; j < NT; ++j) {
#pragma unroll
          for (int p = 0; p < 4; ++p) {
            b[j][u][p] = xv[j] ? mb_ldg(xr[j] + (int64_t)ch * 32 + p * 8) : zero;
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int ch = (s * U + u) * 4 + t;
#pragma unroll
      for (int h = 0; h < 8; ++h) {
        if constexpr (XL) {
          // x read where used (from L1: every block reads the same x), not held in
          // registers from the loads on: 16 registers a u fewer (zeros in 28 of 32 lanes)
          if ((h & 1) == 0) {
#pragma unroll
            for (int j = 0; j < NT; ++j) {
              b[j][u][h >> 1] = xv[j] ? mb_ldg(xr[j] + (int64_t)ch * 32 + (h >> 1) * 8) : zero;
            }
          }
        }
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          const uint32_t v0 = mb_word(q0[i][u], h >> 1) >> ((h & 1) * 16);
          const uint32_t v1 = mb_word(q1[i][u], h >> 1) >> ((h & 1) * 16);
          const uint32_t a0 = mb_deq2(v0, sc0[i][u], bi0[i][u], T{});
          const uint32_t a1 = mb_deq2(v1, sc1[i][u], bi1[i][u], T{});
          const uint32_t a2 = mb_deq2(v0 >> 8, sc0[i][u], bi0[i][u], T{});
          const uint32_t a3 = mb_deq2(v1 >> 8, sc1[i][u], bi1[i][u], T{});
#pragma unroll
          for (int j = 0; j < NT; ++j) {
            const uint4& xb = b[j][u][h >> 1];
            const uint32_t x0 = (h & 1) ? xb.z : xb.x;
            const uint32_t x1 = (h & 1) ? xb.w : xb.y;
            mb_mma(c[i][j], a0, a1, a2, a3, x0, x1, T{});
          }
        }
      }
    }
  }
