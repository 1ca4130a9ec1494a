// engine/backends/cuda/products/wgmma.py: _SOURCE

  constexpr int RB = 64 * WGS;                 // weight rows a block: a warpgroup's 64 each
  constexpr int NT = 128 * WGS;                // threads
  constexpr int NA = 3;                        // stages of dequantized weights
  constexpr int ALBO = RB / 8 * 128 + PADB;    // bytes between A's 8-input core columns
  constexpr int XLBO = BN / 8 * 128 + PADB;
  constexpr int ASZ = 8 * ALBO;                // a stage: 64 inputs
  constexpr int XSZ = 8 * XLBO;
  constexpr int NV = BN / 2;                   // accumulators a thread
  constexpr int XIT = BN * 8 / NT;             // x copies a thread a step
  constexpr int LEAD = NX - 2;                 // steps x is copied ahead
  extern __shared__ __align__(128) unsigned char mb_smem[];
  const uint32_t abase = static_cast<uint32_t>(__cvta_generic_to_shared(mb_smem));
  const uint32_t xbase = abase + NA * ASZ;
  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2, wq = warp & 3;     // warpgroup (64 rows); warp in it (16)
  const int g = lane >> 2, t = lane & 3;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int NW = w_shape[0];
  const int N = GLU ? NW / 2 : NW;
  const int words = K / 8;
  const int groups = K / GS;
  const int steps = K / 64;
  const int TC = GLU ? N / (RB / 2) : NW / RB; // weight tiles
  const int RC = (M + BN - 1) / BN;            // row chunks
  const int tiles = TC * RC;
  const int S = gridDim.x / tiles;             // k-splits
  const int tl = blockIdx.x % tiles;           // a tile's row chunks are neighbours
  const int sp = blockIdx.x / tiles;
  const int tc = tl / RC;
  const int m0 = (tl % RC) * BN;
  const int k0 = steps * sp / S, k1 = steps * (sp + 1) / S;
  const int n_steps = k1 - k0;

  // this thread's weight run: tile row r, inputs 32h..32h+31 of a step
  const int r = tid >> 1, h = tid & 1;
  int wr;
  if constexpr (GLU) {
    const int o = tc * (RB / 2) + (r >> 4) * 8 + (r & 7);
    wr = (r & 8) ? N + o : o;
  } else {
    wr = tc * RB + r;
  }
  const uint32_t* wp = w + (int64_t)wr * words + h * 4;
  const T* scp = scales + (int64_t)wr * groups;
  const T* bip = biases + (int64_t)wr * groups;
  auto wload = [&](int ks) {
    MbWq v;
    v.q = mb_ldg(wp + ks * 8);
    const int gi = (ks * 64 + h * 32) / GS;
    v.s2 = mb_pair(scp[gi]);
    v.b2 = mb_pair(bip[gi]);
    return v;
  };
  // its four 8-input runs: core column 4h + j, row r
  const uint32_t adst = abase + 4 * h * ALBO + (r >> 3) * 128 + (r & 7) * 16;
  auto deq = [&](const MbWq& v, int st) {
    const uint32_t words4[4] = {v.q.x, v.q.y, v.q.z, v.q.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t u = words4[j];
      uint4 o;
      o.x = mb_deq2(u, v.s2, v.b2, T{});
      o.y = mb_deq2(u >> 8, v.s2, v.b2, T{});
      o.z = mb_deq2(u >> 16, v.s2, v.b2, T{});
      o.w = mb_deq2(u >> 24, v.s2, v.b2, T{});
      mb_st16(adst + st * ASZ + j * ALBO, o);
    }
  };
  // x's copies: unit it * NT + tid = row n (unit / 8), inputs 8 kc.. (kc = unit % 8)
  const int kc = tid & 7;
  auto stage_x = [&](int ks, int st) {
#pragma unroll
    for (int it = 0; it < XIT; ++it) {
      const int n = it * (NT / 8) + (tid >> 3);
      const bool ok = m0 + n < M;
      const T* src = ok ? x + (int64_t)(m0 + n) * K + ks * 64 + kc * 8 : x;
      mb_cp16s(xbase + st * XSZ + kc * XLBO + (n >> 3) * 128 + (n & 7) * 16, src, ok);
    }
  };
  // leading offset: between core columns (K); stride: between 8-row groups (the H200
  // gave exact products with this reading and an illegal address with the other)
  const uint64_t da0 = mb_desc(abase + wg * 8 * 128, ALBO, 128);
  const uint64_t dx0 = mb_desc(xbase, XLBO, 128);

  float d[NV];
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    d[v] = 0.f;
  }
  if (n_steps > 0) {
    stage_x(k0, 0);
    mb_commit();
#pragma unroll
    for (int p = 1; p < LEAD; ++p) {  // steps 1 .. LEAD - 1, one commit group each
      if (p < n_steps) {
        stage_x(k0 + p, p);
      }
      mb_commit();
    }
    MbWq p1 = wload(k0), p2 = p1;
    deq(p1, 0);
    if (n_steps > 1) {
      p1 = wload(k0 + 1);
    }
    if constexpr (!WEARLY) {
      if (n_steps > 2) {
        p2 = wload(k0 + 2);
      }
    }
    for (int i = 0; i < n_steps; ++i) {
      mb_wait<LEAD - 1>();  // this thread's copies of step i are in
      mb_fence_async();
      __syncthreads();      // everyone's, and the dequantized weights of step i
      const int sa = i % NA, sx = i % NX;
      mb_wg_fence();
#pragma unroll
      for (int s = 0; s < 4; ++s) {
        mb_wgmma(d, da0 + ((sa * ASZ + 2 * s * ALBO) >> 4), dx0 + ((sx * XSZ + 2 * s * XLBO) >> 4),
                 T{}, mb_n<BN>{});
      }
      mb_wg_commit();
      // WEARLY: step i + 2's weights now, so that their loads fly during the copies,
      // the dequantization and the wait below: the fence at the loop's top compiles to
      // MEMBAR.ALL.CTA + FENCE.VIEW.ASYNC.S (SASS), which may hold each thread until its
      // loads in flight are in, so loads issued at the end of a step are waited for
      // almost at once
      if constexpr (WEARLY) {
        if (i + 2 < n_steps) {
          p2 = wload(k0 + i + 2);
        }
      }
      // while the tensor cores run step i: step i + LEAD's x, step i + 1's weights
      if (i + LEAD < n_steps) {
        stage_x(k0 + i + LEAD, (i + LEAD) % NX);
      }
      mb_commit();
      if (i + 1 < n_steps) {
        deq(p1, (i + 1) % NA);
        p1 = p2;
        if constexpr (!WEARLY) {
          if (i + 3 < n_steps) {
            p2 = wload(k0 + i + 3);
          }
        }
      }
      mb_wg_wait<1>();  // step i - 1 is done: its buffers are free after the next barrier
    }
    mb_wg_wait<0>();
  }
#pragma unroll
  for (int v = 0; v < NV; ++v) {
    mb_keep(d[v]);
  }

  if constexpr (SPLIT) {
    if (S > 1) {
      // this split's sums, value-major; the last of the tile's S blocks adds them all
      // in split order
      float* mine = const_cast<float*>(wsp) + (int64_t)blockIdx.x * NV * NT + tid;
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        mine[v * NT] = d[v];
      }
      if (!mb_last_of(const_cast<int*>(cnt) + tl, S)) {
        return;
      }
#pragma unroll
      for (int v = 0; v < NV; ++v) {
        d[v] = 0.f;
      }
      for (int s2 = 0; s2 < S; ++s2) {
        const float* part = wsp + (int64_t)(s2 * tiles + tl) * NV * NT + tid;
#pragma unroll
        for (int v = 0; v < NV; ++v) {
          d[v] += __ldcg(part + v * NT);
        }
      }
    }
  }

  // accumulator layout: warp wq of the warpgroup holds its rows 16 wq + g (d[4j], d[4j+1])
  // and 16 wq + g + 8 (d[4j+2], d[4j+3]), x rows 8j + 2t and 8j + 2t + 1
  const int R0 = wg * 64 + wq * 16 + g;
#pragma unroll
  for (int j = 0; j < BN / 8; ++j) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = m0 + j * 8 + 2 * t + e;
      if (m < M) {
        if constexpr (GLU) {
          const int o = tc * (RB / 2) + (wg * 4 + wq) * 8 + g;
          const float gs = d[4 * j + e], us = d[4 * j + 2 + e];
          y[(int64_t)m * N + o] = static_cast<T>(gs / (1.f + __expf(-gs)) * us);
        } else {
          const int row0 = tc * RB + R0, row1 = row0 + 8;
          float v0 = d[4 * j + e], v1 = d[4 * j + 2 + e];
          if constexpr (RES) {
            v0 += static_cast<float>(r_in[(int64_t)m * N + row0]);
            v1 += static_cast<float>(r_in[(int64_t)m * N + row1]);
          }
          y[(int64_t)m * N + row0] = static_cast<T>(v0);
          y[(int64_t)m * N + row1] = static_cast<T>(v1);
        }
      }
    }
  }
