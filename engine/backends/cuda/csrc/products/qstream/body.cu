// engine/backends/cuda/products/qstream.py: _BODY

  constexpr int NT = WARPS * 32;
  constexpr int CPR = K / 32;       // 32-input chunks a row
  constexpr int J = CPR / 32;       // a lane's chunks a row
  constexpr int G = K / GS;         // quantization groups a row
  constexpr int XC = 9;             // float4s a chunk of x takes: 8 and one of padding
  extern __shared__ __align__(16) unsigned char mb_smem[];
  float4* xs = reinterpret_cast<float4*>(mb_smem);                         // [CPR * XC]
  float* xsum = reinterpret_cast<float*>(mb_smem + CPR * XC * 16);         // [CPR]
  uint4* wslot = reinterpret_cast<uint4*>(mb_smem + CPR * XC * 16 + CPR * 4);  // [STAGES][NT]
  uint32_t* sslot = reinterpret_cast<uint32_t*>(wslot + STAGES * NT);       // [STAGES][NT]
  uint32_t* bslot = sslot + STAGES * NT;                                     // [STAGES][NT]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int gw = blockIdx.x * WARPS + (tid >> 5);
  const int TW = gridDim.x * WARPS;
  const int N = GLU ? w_shape[0] / 2 : w_shape[0];  // outputs
  // 0 at run time, unknown to the compiler: keeps the exponent-trick constant in a
  // register (ptxas otherwise rematerializes the masks before every LOP3)
  const uint32_t magic = 0x4B000000u | (static_cast<uint32_t>(N) >> 31);

  // x as float32 in shared memory, a chunk every 144 bytes: the 8 lanes of a 16-byte
  // load phase (chunks l..l+7) then hit 8 different bank groups
  for (int c = tid; c < CPR; c += NT) {
    float s = 0.f;
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      const uint4 v = *reinterpret_cast<const uint4*>(x + c * 32 + p * 8);
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
      float f[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = mb_half_of(h[i], false, T{});
        f[2 * i + 1] = mb_half_of(h[i], true, T{});
        s += f[2 * i] + f[2 * i + 1];
      }
      xs[c * XC + 2 * p] = make_float4(f[0], f[1], f[2], f[3]);
      xs[c * XC + 2 * p + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
    xsum[c] = s;
  }
  __syncthreads();

  // this lane's walk: outputs o = gw, gw + TW, ...; per output its rows (gate, up);
  // per row the chunks lane + 32 j
  const int units = gw < N ? (N - 1 - gw) / TW + 1 : 0;
  const int total = units * J * (GLU ? 2 : 1);
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(scales);
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(biases);
  int i_o = gw, i_rr = 0, i_j = 0;  // the next chunk to load
  auto issue = [&](int q) {
    const uint32_t row = static_cast<uint32_t>(i_o + (GLU && i_rr ? N : 0));
    const int s = (q % STAGES) * NT + tid;
    // 32-bit indices (a weight of up to 2^31 words), the chunk's group: two groups'
    // values a 4-byte word (G is even)
    const uint32_t wi = row * (K / 8) + lane * 4 + i_j * 128;
    const uint32_t gi = row * G + (lane * 32) / GS + i_j * (1024 / GS);
    mb_cp16(&wslot[s], w + wi);
    mb_cp4(&sslot[s], sw + (gi >> 1));
    mb_cp4(&bslot[s], bw + (gi >> 1));
    if (++i_j == J) {
      i_j = 0;
      if (GLU && i_rr == 0) {
        i_rr = 1;
      } else {
        i_rr = 0;
        i_o += TW;
      }
    }
  };
  int c_o = gw, c_rr = 0, c_j = 0;  // the chunk to compute
  float acc = 0.f, gate = 0.f;
  mb_ring<STAGES>(total, issue, [&](const int s) {  // s: the slot of this chunk
    const uint4 wv = wslot[s * NT + tid];
    const uint32_t sv = sslot[s * NT + tid];
    const uint32_t bv = bslot[s * NT + tid];
    const int col = lane + 32 * c_j;
    const float4* xc = xs + col * XC;
    const uint32_t ws[4] = {wv.x, wv.y, wv.z, wv.w};
    // p[k]: sum of x * q * 16^k over the values at nibble k of a half word
    float p0 = 0.f, p1 = 0.f, p2 = 0.f, p3 = 0.f;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 xa = xc[2 * i];
      const float4 xb = xc[2 * i + 1];
      const uint32_t lo = ws[i];
      const uint32_t hi = ws[i] >> 16;
      p0 = fmaf(xa.x, mb_nib(lo, 0xFu, magic), p0);
      p1 = fmaf(xa.y, mb_nib(lo, 0xF0u, magic), p1);
      p2 = fmaf(xa.z, mb_nib(lo, 0xF00u, magic), p2);
      p3 = fmaf(xa.w, mb_nib(lo, 0xF000u, magic), p3);
      p0 = fmaf(xb.x, mb_nib(hi, 0xFu, magic), p0);
      p1 = fmaf(xb.y, mb_nib(hi, 0xF0u, magic), p1);
      p2 = fmaf(xb.z, mb_nib(hi, 0xF00u, magic), p2);
      p3 = fmaf(xb.w, mb_nib(hi, 0xF000u, magic), p3);
    }
    const float dot = p0 + p1 * 0.0625f + p2 * 0.00390625f + p3 * 0.000244140625f;
    const bool hi_half = (((lane * 32) / GS + c_j * (1024 / GS)) & 1) != 0;
    const float sc = mb_half_of(sv, hi_half, T{});
    const float bi = mb_half_of(bv, hi_half, T{});
    acc = fmaf(sc, dot, fmaf(bi, xsum[col], acc));
    if (++c_j == J) {  // the row's last chunk: its sum, across the warp
      c_j = 0;
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        acc += __shfl_xor_sync(0xffffffffu, acc, off);
      }
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
