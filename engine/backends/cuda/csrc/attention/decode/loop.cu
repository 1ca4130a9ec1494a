// engine/backends/cuda/attention/decode.py: _LOOP

  for (int base = t0 + warp * PW; base < t_end; base += WARPS * PW * U) {
    float kr[U][PER];
    float vr[U][PER];
    uint32_t kw[U][WORDS];  // VEC: the loaded bytes, converted where used
    uint32_t vw[U][WORDS];
    bool ok[U];
#pragma unroll
    for (int j = 0; j < U; ++j) {
      const int t = base + sub + j * WARPS * PW;
      ok[j] = t < t_end;
      if constexpr (VEC) {
        if (ok[j]) {
          mb_load_raw<WORDS>(kb + t * ts_k, kw[j]);
          mb_load_raw<WORDS>(vb + t * ts_v, vw[j]);
        } else {
#pragma unroll
          for (int w = 0; w < WORDS; ++w) {
            kw[j][w] = 0u;
            vw[j][w] = 0u;
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          kr[j][i] = ok[j] ? static_cast<float>(kb[t * ts_k + i]) : 0.f;
          vr[j][i] = ok[j] ? static_cast<float>(vb[t * ts_v + i]) : 0.f;
        }
      }
    }
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float s[U];
#pragma unroll
      for (int j = 0; j < U; ++j) {
        float d = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          float k;
          if constexpr (VEC) {
            k = mb_elem(kw[j], i, T{});
          } else {
            k = kr[j][i];
          }
          d += qr[g][i] * k;
        }
        s[j] = d;
      }
#pragma unroll
      for (int off = LP / 2; off > 0; off >>= 1) {
#pragma unroll
        for (int j = 0; j < U; ++j) {
          s[j] += __shfl_xor_sync(0xffffffff, s[j], off);
        }
      }
      float mx = m[g];
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (ok[j]) {
          mx = fmaxf(mx, s[j]);
        }
      }
      // a position group with nothing valid yet (PW > 1: a lane's position can be past
      // the end while another's in the warp is not): m and mx are both -inf
      const float corr = mx == -INFINITY ? 0.f : expf(m[g] - mx);
      float lsum = l[g] * corr;
      float a[PER];
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        a[i] = acc[g][i] * corr;
      }
#pragma unroll
      for (int j = 0; j < U; ++j) {
        if (ok[j]) {
          const float p = expf(s[j] - mx);
          lsum += p;
#pragma unroll
          for (int i = 0; i < PER; ++i) {
            float v;
            if constexpr (VEC) {
              v = mb_elem(vw[j], i, T{});
            } else {
              v = vr[j][i];
            }
            a[i] += p * v;
          }
        }
      }
      m[g] = mx;
      l[g] = lsum;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        acc[g][i] = a[i];
      }
    }
  }
