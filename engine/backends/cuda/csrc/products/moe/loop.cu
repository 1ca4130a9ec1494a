// RR weight rows a warp: rows r < R of w (and with GLU rows R + r of w2, the same
// feature of the up projection); acc[m][r] over the chunk's pairs. PICK(a, b): the
// GLU's choice of the up projection's (a) or the gate's (b) arrays, set by moe.py
  for (int m0 = 0; m0 < n_pairs; m0 += MMAX) {
    const int mc = min(MMAX, n_pairs - m0);
    const T* xr[MMAX];
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
      const int p = pairs[m0 + (m < mc ? m : 0)];
      xr[m] = x + static_cast<int64_t>(p / DIV) * K;
    }
    float acc[MMAX][RR];
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
#pragma unroll
      for (int r = 0; r < RR; ++r) {
        acc[m][r] = 0.f;
      }
    }
    for (int c = lane; c < chunks; c += 32) {
      const int k0 = c * 32;
      const int g = k0 / GS;
      uint4 wq[RR];
      float sc[RR];
      float bs[RR];
#pragma unroll
      for (int r = 0; r < RR; ++r) {
        const int64_t n = n0 + (r % R);
        const uint32_t* wp = PICK(w2, w);
        const T* sp = PICK(scales2, scales);
        const T* bp = PICK(biases2, biases);
        wq[r] = reinterpret_cast<const uint4*>(wp + wbase + n * words)[c];
        sc[r] = static_cast<float>(sp[sbase + n * groups + g]);
        bs[r] = static_cast<float>(bp[sbase + n * groups + g]);
      }
      float d[MMAX][RR];
      float xs[MMAX];
#pragma unroll
      for (int m = 0; m < MMAX; ++m) {
        xs[m] = 0.f;
#pragma unroll
        for (int r = 0; r < RR; ++r) {
          d[m][r] = 0.f;
        }
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        float qf[RR][8];
#pragma unroll
        for (int r = 0; r < RR; ++r) {
          const uint32_t word = j == 0 ? wq[r].x : j == 1 ? wq[r].y : j == 2 ? wq[r].z : wq[r].w;
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            qf[r][i] = __uint_as_float(0x4B000000u | ((word >> (4 * i)) & 0xFu)) - 8388608.f;
          }
        }
#pragma unroll
        for (int m = 0; m < MMAX; ++m) {
          if (m < mc) {
            const uint4 xu = reinterpret_cast<const uint4*>(xr[m] + k0)[j];
            float xv[8];
            mb_moe_to_float8(xu, xv, T{});
#pragma unroll
            for (int i = 0; i < 8; ++i) {
              xs[m] += xv[i];
#pragma unroll
              for (int r = 0; r < RR; ++r) {
                d[m][r] += xv[i] * qf[r][i];
              }
            }
          }
        }
      }
#pragma unroll
      for (int m = 0; m < MMAX; ++m) {
#pragma unroll
        for (int r = 0; r < RR; ++r) {
          acc[m][r] += sc[r] * d[m][r] + bs[r] * xs[m];
        }
      }
    }
#pragma unroll
    for (int m = 0; m < MMAX; ++m) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const float v = mb_moe_warp_sum(acc[m][r]);
        float out = v;
        if (ACT != 0) {
          const float gate = static_cast<float>(static_cast<T>(v));
          const float up = static_cast<float>(static_cast<T>(mb_moe_warp_sum(acc[m][RR - R + r])));
          float a;
          if (ACT == 1) {
            a = gate / (1.f + __expf(-gate));
          } else {
            a = 0.5f * gate * (1.f + tanhf(0.7978845608028654f * (gate + 0.044715f * gate * gate * gate)));
          }
          out = static_cast<float>(static_cast<T>(a)) * up;
        }
        if (lane == 0 && m < mc) {
          y[static_cast<int64_t>(pairs[m0 + m]) * N + n0 + r] = static_cast<T>(out);
        }
      }
    }
  }
