// engine/backends/cuda/products/qstream.py: _MMA_BODY
// The tensor-core form (``mma``): a warp owns 16 weight rows (an m-tile; with the SwiGLU
// 8 gate rows and their 8 up rows) and walks K in blocks of 8 quantization groups. In
// one mma.sync.m16n8k16 the 16 k of a lane's A pairs are 2 values from each of the
// block's 8 groups (k pair 2j, 2j+1 <- group j), and B's column n holds x only for the
// k of group n, so C[row, n] sums group n alone: the scale and bias of each group go on
// once a block (C's 8 columns are the 8 groups), and the weight enters the MMA as the
// raw 4-bit value plus a constant (one LOP3 for two values: (w >> 4s) & 0x000F000F |
// 0x43004300 is the bf16 pair 128 + q_s, 128 + q_{s+4}); the constant comes off with
// the group's sum of x. About one instruction a weight, against ~5 on CUDA cores.

  constexpr int NT = WARPS * 32;
  constexpr int NG = K / GS;        // quantization groups a row
  constexpr int KB = NG / 8;        // blocks of 8 groups a row
  constexpr int GW = GS / 8;        // 32-bit words (8 values) a group
  constexpr int SEGC = GS / 32;     // 16-byte chunks of one group's weights
  constexpr int CH = 4 * SEGC;      // chunks a lane loads a block: rows g, g+8 x groups t, t+4
  constexpr int XG = GS / 2 + 4;    // words of x pairs a group takes in shared memory
  extern __shared__ __align__(16) unsigned char mb_smem[];
  uint32_t* xp = reinterpret_cast<uint32_t*>(mb_smem);                  // [NG * XG]
  float* xsum = reinterpret_cast<float*>(xp + NG * XG);                 // [NG]
  uint4* zero4 = reinterpret_cast<uint4*>(xsum + NG);                   // [1]
  uint4* wslot = zero4 + 1;                                             // [STAGES][CH][NT]
  uint32_t* sbslot = reinterpret_cast<uint32_t*>(wslot + STAGES * CH * NT);  // [STAGES][4][NT]
  const int tid = threadIdx.x;
  const int lane = tid & 31;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int gw = blockIdx.x * WARPS + (tid >> 5);
  const int TW = gridDim.x * WARPS;
  const int NW = w_shape[0];
  const int N = GLU ? NW / 2 : NW;  // outputs
  const int tiles = GLU ? N / 8 : N / 16;
  // the exponent-trick constant of T (bf16: 128 + q, fp16: 1024 + q), from a value the
  // compiler cannot see, so that it stays in a register
  const uint32_t hz = static_cast<uint32_t>(NW) >> 31;
  const uint32_t magic = (mb_is_half(T{}) ? 0x64006400u : 0x43004300u) | hz;
  const float qoff = mb_is_half(T{}) ? 1024.f : 128.f;

  // x in shared memory as the MMA's B pairs: group j's word m = (x[8(m/4) + m%4],
  // x[8(m/4) + m%4 + 4]) of the group, the pair a LOP3 makes of weight word m/4 shifted
  // by 4(m%4); groups XG words apart (4 of padding: the 8 lanes that read x in one
  // load hit different banks); and each group's sum of x
  for (int j = tid; j < NG; j += NT) {
    float sum = 0.f;
#pragma unroll
    for (int wd = 0; wd < GW; ++wd) {
      const uint4 v = *reinterpret_cast<const uint4*>(x + j * GS + wd * 8);
      const uint32_t h[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        sum += mb_half_of(h[i], false, T{}) + mb_half_of(h[i], true, T{});
      }
      uint4 o;
      o.x = __byte_perm(h[0], h[2], 0x5410);  // (e0, e4)
      o.y = __byte_perm(h[0], h[2], 0x7632);  // (e1, e5)
      o.z = __byte_perm(h[1], h[3], 0x5410);  // (e2, e6)
      o.w = __byte_perm(h[1], h[3], 0x7632);  // (e3, e7)
      *reinterpret_cast<uint4*>(xp + j * XG + wd * 4) = o;
    }
    xsum[j] = sum;
  }
  if (tid == 0) {
    zero4[0] = make_uint4(0u, 0u, 0u, 0u);
  }
  __syncthreads();

  const int units = gw < tiles ? (tiles - 1 - gw) / TW + 1 : 0;
  const int total = units * KB;
  const uint32_t* sw = reinterpret_cast<const uint32_t*>(scales);
  const uint32_t* bw = reinterpret_cast<const uint32_t*>(biases);
  auto rows_of = [&](int u, uint32_t& r0, uint32_t& r1) {
    r0 = static_cast<uint32_t>(GLU ? u * 8 + g : u * 16 + g);
    r1 = static_cast<uint32_t>(GLU ? N + u * 8 + g : u * 16 + g + 8);
  };
  int i_u = gw, i_kb = 0;  // the next stage to load: m-tile, block
  auto issue = [&](int q) {
    uint32_t r0, r1;
    rows_of(i_u, r0, r1);
    const int s = q % STAGES;
#pragma unroll
    for (int ri = 0; ri < 2; ++ri) {
#pragma unroll
      for (int gi = 0; gi < 2; ++gi) {
        const uint32_t row = ri ? r1 : r0;
        const uint32_t base = row * (K / 8) + (i_kb * 8 + t + 4 * gi) * GW;
#pragma unroll
        for (int c = 0; c < SEGC; ++c) {
          mb_cp16(&wslot[(s * CH + (ri * 2 + gi) * SEGC + c) * NT + tid], w + base + c * 4);
        }
      }
    }
    // the scales and biases of C's columns 2t, 2t+1 (groups 2t, 2t+1 of the block):
    // one 4-byte word a row
    const uint32_t gs0 = (r0 * NG + i_kb * 8 + 2 * t) >> 1;
    const uint32_t gs1 = (r1 * NG + i_kb * 8 + 2 * t) >> 1;
    mb_cp4(&sbslot[(s * 4 + 0) * NT + tid], sw + gs0);
    mb_cp4(&sbslot[(s * 4 + 1) * NT + tid], sw + gs1);
    mb_cp4(&sbslot[(s * 4 + 2) * NT + tid], bw + gs0);
    mb_cp4(&sbslot[(s * 4 + 3) * NT + tid], bw + gs1);
    if (++i_kb == KB) {
      i_kb = 0;
      i_u += TW;
    }
  };
  // B's sources: lane (g, t) holds x in b0 only when g == t (k pair 2t, 2t+1 is group
  // t = n) and in b1 only when g == t + 4; the others read a zero word
  const bool real0 = g == t;
  const bool real1 = g == t + 4;
  int c_u = gw, c_kb = 0;
  float acc0 = 0.f, acc1 = 0.f;
  mb_ring<STAGES>(total, issue, [&](const int s) {
    const uint4* xq0 = real0 ? reinterpret_cast<const uint4*>(xp + (c_kb * 8 + g) * XG) : zero4;
    const uint4* xq1 = real1 ? reinterpret_cast<const uint4*>(xp + (c_kb * 8 + g) * XG) : zero4;
    const int st0 = real0 ? 1 : 0;
    const int st1 = real1 ? 1 : 0;
    float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int c4 = 0; c4 < SEGC; ++c4) {
      // 4 words of each segment aRG: row g (R 0) or g+8 (R 1), group t (G 0) or t+4 (G 1)
      // (the slots hold segment R * 2 + G)
      const uint4 a00 = wslot[(s * CH + 0 * SEGC + c4) * NT + tid];
      const uint4 a01 = wslot[(s * CH + 1 * SEGC + c4) * NT + tid];
      const uint4 a10 = wslot[(s * CH + 2 * SEGC + c4) * NT + tid];
      const uint4 a11 = wslot[(s * CH + 3 * SEGC + c4) * NT + tid];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int wd = c4 * 4 + i;  // the word of the group
        const uint32_t w00 = mb_word(a00, i), w01 = mb_word(a01, i);
        const uint32_t w10 = mb_word(a10, i), w11 = mb_word(a11, i);
        const uint4 x0 = xq0[wd * st0];
        const uint4 x1 = xq1[wd * st1];
#pragma unroll
        for (int sh = 0; sh < 4; ++sh) {
          const uint32_t p00 = ((w00 >> (4 * sh)) & 0x000F000Fu) | magic;
          const uint32_t p01 = ((w01 >> (4 * sh)) & 0x000F000Fu) | magic;
          const uint32_t p10 = ((w10 >> (4 * sh)) & 0x000F000Fu) | magic;
          const uint32_t p11 = ((w11 >> (4 * sh)) & 0x000F000Fu) | magic;
          // A: a0 row g, k 2t..2t+1 (group t); a1 row g+8, same k; a2 row g, k 2t+8..2t+9
          // (group t+4); a3 row g+8, group t+4
          mb_mma(c, p00, p10, p01, p11, mb_word(x0, sh), mb_word(x1, sh), T{});
        }
      }
    }
    // C[row][n] = sum over group n of x * (qoff + q): y += s * C + X * (b - qoff * s)
    const uint32_t s0w = sbslot[(s * 4 + 0) * NT + tid];
    const uint32_t s1w = sbslot[(s * 4 + 1) * NT + tid];
    const uint32_t b0w = sbslot[(s * 4 + 2) * NT + tid];
    const uint32_t b1w = sbslot[(s * 4 + 3) * NT + tid];
    const float xa = xsum[c_kb * 8 + 2 * t];
    const float xb = xsum[c_kb * 8 + 2 * t + 1];
    {
      const float s00 = mb_half_of(s0w, false, T{}), s01 = mb_half_of(s0w, true, T{});
      const float s10 = mb_half_of(s1w, false, T{}), s11 = mb_half_of(s1w, true, T{});
      const float b00 = mb_half_of(b0w, false, T{}), b01 = mb_half_of(b0w, true, T{});
      const float b10 = mb_half_of(b1w, false, T{}), b11 = mb_half_of(b1w, true, T{});
      acc0 = fmaf(s00, c[0], fmaf(xa, fmaf(-qoff, s00, b00), acc0));
      acc0 = fmaf(s01, c[1], fmaf(xb, fmaf(-qoff, s01, b01), acc0));
      acc1 = fmaf(s10, c[2], fmaf(xa, fmaf(-qoff, s10, b10), acc1));
      acc1 = fmaf(s11, c[3], fmaf(xb, fmaf(-qoff, s11, b11), acc1));
    }
    if (++c_kb == KB) {  // the m-tile's last block: the 4 lanes of a row group add up
      c_kb = 0;
      acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
      acc0 += __shfl_xor_sync(0xffffffffu, acc0, 2);
      acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
      acc1 += __shfl_xor_sync(0xffffffffu, acc1, 2);
      if (t == 0) {
        uint32_t r0, r1;
        rows_of(c_u, r0, r1);
        if constexpr (GLU) {
          y[r0] = static_cast<T>(acc0 / (1.f + __expf(-acc0)) * acc1);
        } else {
          float v0 = acc0, v1 = acc1;
          if constexpr (RES) {
            v0 += static_cast<float>(r[r0]);
            v1 += static_cast<float>(r[r1]);
          }
          y[r0] = static_cast<T>(v0);
          y[r1] = static_cast<T>(v1);
        }
      }
      acc0 = 0.f;
      acc1 = 0.f;
      c_u += TW;
    }
  });
