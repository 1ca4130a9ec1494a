// engine/backends/cuda/products/qstream.py: _IBODY
// The integer form (``q4i``, the default): the same ring and walk as
// ``_BODY``, but x is held as int16 with a power-of-two scale per 32-input chunk
// (2^(14 - e), e the exponent of the chunk's largest |x|: every bf16 value within 2^7
// of that largest, every fp16 one within 2^4, becomes an integer exactly; smaller ones
// are rounded at 2^-15 of it), and a chunk's dot product is integer arithmetic. A
// weight word's 8 values become two words of bytes by one LOP3 each (w & 0x0F0F0F0F:
// values 0, 2, 4, 6; w & 0xF0F0F0F0: 16 x values 1, 3, 5, 7, read as unsigned bytes,
// so no shift), and each of those meets two int16 pairs of x in a DP2A (two 16 x 8-bit
// products added to an int32). Both sums stay below 2^23 (after the 16 comes off),
// so they convert to float exactly; scale, bias and x's chunk sum (float32) go on as
// before. A slot holds CPS chunks of a lane, so the ring's bookkeeping is paid once for
// them. SASS (bench/gpu/nvrtc_check.py --sass): ~74 instructions a 32-weight chunk
// (2.3 a weight) against ~170 for ``_BODY``.

  constexpr int NT = WARPS * 32;
  constexpr int CPR = K / 32;       // 32-input chunks a row
  constexpr int J = CPR / 32;       // a lane's chunks a row
  constexpr int G = K / GS;         // quantization groups a row
  // uint4s a chunk of x takes: its 4 weight words' int16 pairs, then (1 / scale, sum
  // of x); 80 bytes, so the 8 lanes of a 16-byte load phase hit 8 different bank groups
  constexpr int XC = 5;
  extern __shared__ __align__(16) unsigned char mb_smem[];
  uint4* xq = reinterpret_cast<uint4*>(mb_smem);                         // [CPR * XC]
  uint4* wslot = xq + CPR * XC;                                      // [STAGES][CPS][NT]
  uint32_t* sslot = reinterpret_cast<uint32_t*>(wslot + STAGES * CPS * NT);  // [STAGES][CPS][NT]
  uint32_t* bslot = sslot + STAGES * CPS * NT;                               // [STAGES][CPS][NT]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int gw = blockIdx.x * WARPS + (tid >> 5);
  const int TW = gridDim.x * WARPS;
  const int N = GLU ? w_shape[0] / 2 : w_shape[0];  // outputs

  // a slot holds CPS chunks of a lane (j, j + 1, ...: CPS cp.async each, one commit
  // group), so the ring's bookkeeping is paid once for CPS chunks
  constexpr int JS = J / CPS;       // a lane's slots a row
  static_assert(J % CPS == 0, "CPS must divide K / 1024");
  const int units = gw < N ? (N - 1 - gw) / TW + 1 : 0;
  const int total = units * JS * (GLU ? 2 : 1);
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(scales);
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(biases);
  int i_o = gw, i_rr = 0, i_j = 0;  // the next slot to load: output, gate/up, first chunk
  auto issue = [&](int q) {
    const uint32_t row = static_cast<uint32_t>(i_o + (GLU && i_rr ? N : 0));
    const int s = (q % STAGES) * CPS * NT + tid;
#pragma unroll
    for (int c = 0; c < CPS; ++c) {
      const uint32_t wi = row * (K / 8) + lane * 4 + (i_j + c) * 128;
      const uint32_t gi = row * G + (lane * 32) / GS + (i_j + c) * (1024 / GS);
      mb_cp16(&wslot[s + c * NT], w + wi);
      mb_cp4(&sslot[s + c * NT], sw + (gi >> 1));
      mb_cp4(&bslot[s + c * NT], bw + (gi >> 1));
    }
    i_j += CPS;
    if (i_j == J) {
      i_j = 0;
      if (GLU && i_rr == 0) {
        i_rr = 1;
      } else {
        i_rr = 0;
        i_o += TW;
      }
    }
  };
  // EARLY: the ring's first loads go out before x's conversion (they do not need it),
  // so the weights' HBM latency runs under the prologue instead of after it
  if constexpr (EARLY) {
    mb_ring_start<STAGES>(total, issue);
  }

  // NORM: x's sum of squares over this thread's chunks (the block's total makes the
  // RMSNorm's 1 / rms, which goes on each output at the end: the product is linear in
  // x), and the chunks hold x times the norm's weight
  float ss = 0.f;
  for (int c = tid; c < CPR; c += NT) {
    float f[32];
    float s = 0.f, amax = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint4 v = *reinterpret_cast<const uint4*>(x + c * 32 + p * 8);
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[8 * p + 2 * i] = mb_half_of(h[i], false, T{});
        f[8 * p + 2 * i + 1] = mb_half_of(h[i], true, T{});
      }
      if constexpr (NORM) {
        const uint4 gv = *reinterpret_cast<const uint4*>(nw + c * 32 + p * 8);
        const uint32_t g[4] = {gv.x, gv.y, gv.z, gv.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          float& f0 = f[8 * p + 2 * i];
          float& f1 = f[8 * p + 2 * i + 1];
          ss = fmaf(f0, f0, fmaf(f1, f1, ss));
          f0 *= mb_half_of(g[i], false, T{});
          f1 *= mb_half_of(g[i], true, T{});
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      s += f[i];
      amax = fmaxf(amax, fabsf(f[i]));
    }
    // up = 2^(141 - e) puts the largest |x| in [2^14, 2^15); 1 / up = 2^(e - 141);
    // e clamped so that both are normal floats; NaN or Inf in the chunk (fmaxf skips
    // NaN, the sum does not): 1 / up is NaN, so the chunk's dot product is
    const int e = min(max(static_cast<int>((__float_as_uint(amax) >> 23) & 0xFFu), 15), 254);
    const float up = __uint_as_float(static_cast<uint32_t>(268 - e) << 23);
    const float down = fabsf(s) <= 3.0e38f
                           ? __uint_as_float(static_cast<uint32_t>(e - 14) << 23)
                           : __uint_as_float(0x7fc00000u);
    uint32_t q16[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      q16[i] = static_cast<uint32_t>(__float2int_rn(f[i] * up)) & 0xFFFFu;
    }
#pragma unroll
    for (int wd = 0; wd < 4; ++wd) {
      const uint32_t* qw = q16 + 8 * wd;
      xq[c * XC + wd] = make_uint4(qw[0] | (qw[2] << 16), qw[4] | (qw[6] << 16),
                                   qw[1] | (qw[3] << 16), qw[5] | (qw[7] << 16));
    }
    xq[c * XC + 4] = make_uint4(__float_as_uint(down), __float_as_uint(s), 0u, 0u);
  }
  __shared__ float mb_ss[WARPS];
  if constexpr (NORM) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      ss += __shfl_xor_sync(0xffffffffu, ss, off);
    }
    if (lane == 0) {
      mb_ss[tid >> 5] = ss;
    }
  }
  __syncthreads();
  float rn = 1.f;  // NORM: 1 / rms of x, as MLX's rms_norm: rsqrt(mean(x^2) + eps)
  if constexpr (NORM) {
    float t = 0.f;
#pragma unroll
    for (int i = 0; i < WARPS; ++i) {
      t += mb_ss[i];
    }
    rn = rsqrtf(t / static_cast<float>(K) + eps[0]);
  }

  int c_o = gw, c_rr = 0, c_j = 0;  // the slot to compute
  float acc = 0.f, gate = 0.f;
  mb_ring<STAGES, EARLY>(total, issue, [&](const int s) {  // s: the slot
#pragma unroll
    for (int c = 0; c < CPS; ++c) {
      const int si = (s * CPS + c) * NT + tid;
      const uint4 wv = wslot[si];
      const uint32_t sv = sslot[si];
      const uint32_t bv = bslot[si];
      if constexpr (ABL) {  // bench only: the stream without the math (is it issue-bound?)
        acc += __uint_as_float((wv.x ^ wv.y ^ wv.z ^ wv.w ^ sv ^ bv) & 0x3f7fffffu);
        continue;
      }
      const int col = lane + 32 * (c_j + c);
      const uint4* xc = xq + col * XC;
      const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
      // de: x times values 0, 2, 4, 6 of each word (bytes of w & 0x0F0F0F0F); dd: x times
      // 16 x values 1, 3, 5, 7 (bytes of w & 0xF0F0F0F0, unsigned: no shift needed)
      int de = 0, dd = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const uint4 xv = xc[i];
        const uint32_t even = ws[i] & 0x0F0F0F0Fu;
        const uint32_t odd = ws[i] & 0xF0F0F0F0u;
        de = mb_dp2a_lo(xv.x, even, de);
        de = mb_dp2a_hi(xv.y, even, de);
        dd = mb_dp2a_lo_u(xv.z, odd, dd);
        dd = mb_dp2a_hi_u(xv.w, odd, dd);
      }
      const uint2 ds = *reinterpret_cast<const uint2*>(xc + 4);  // (1 / scale, sum of x)
      // |de| and |dd| / 16 are below 2^23, their sum below 2^24: exact in float
      const float dot = fmaf(static_cast<float>(dd), 0.0625f, static_cast<float>(de)) *
                        __uint_as_float(ds.x);
      const bool hi_half = (((lane * 32) / GS + (c_j + c) * (1024 / GS)) & 1) != 0;
      const float sc = mb_half_of(sv, hi_half, T{});
      const float bi = mb_half_of(bv, hi_half, T{});
      acc = fmaf(sc, dot, fmaf(bi, __uint_as_float(ds.y), acc));
    }
    c_j += CPS;
    if (c_j == J) {  // the row's last chunk: its sum, across the warp
      c_j = 0;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
      }
      acc *= rn;
      if (GLU && c_rr == 0) {
        gate = acc;
        c_rr = 1;
      } else {
        if (lane == 0) {
          float v = acc;
          if constexpr (GLU) {
            v = gate / (1.f + __expf(-gate)) * acc;
          }
          if constexpr (RES) {
            v += static_cast<float>(r[c_o]);
          }
          y[c_o] = static_cast<T>(v);
        }
        c_rr = 0;
        c_o += TW;
      }
      acc = 0.f;
    }
  });
