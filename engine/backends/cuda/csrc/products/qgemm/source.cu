// engine/backends/cuda/products/qgemm.py: _SOURCE

  constexpr int BM = NTW * 8;        // x rows a block
  constexpr int XU = BM * 16;        // 16-byte units of x a step (BM rows x 128 inputs)
  constexpr int NTH = WM * 32;
  extern __shared__ __align__(16) unsigned char mb_smem[];
  // a stage: x [NTW][4][8][4] units
  constexpr int SSZ = XU;
  uint4* xs = reinterpret_cast<uint4*>(mb_smem);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int g = lane >> 2;
  const int t = lane & 3;
  const int M = x_shape[0];
  const int K = x_shape[1];
  const int NW = w_shape[0];
  const int N = GLU ? NW / 2 : NW;  // outputs a row
  const int RC = (M + BM - 1) / BM;
  const int words = K / 8;
  const int groups = K / GS;
  const int steps = K / 128;
  // The work: tile tl is BM x rows ((tl % RC) * BM..) by the weight m-tiles of block
  // column tl / RC (the row chunks of one weight tile are neighbours: the tile from HBM
  // once), in `steps` k-steps; item it = tl * steps + ks. One tile a block, or (SK,
  // stream-K) an even share of all the items a block, cut across tiles, so that every
  // block of the grid (the SMs' worth, and never more blocks than items: each has one at
  // least) has as much to do: a tile that several blocks share is summed, in block
  // order, by the last of them to finish its part.
  int it0, it1;
  int64_t items = 0;
  if constexpr (SK) {
    items = static_cast<int64_t>((NW / 16) / (WM * MT)) * RC * steps;
    it0 = static_cast<int>(items * blockIdx.x / gridDim.x);
    it1 = static_cast<int>(items * (blockIdx.x + 1) / gridDim.x);
  } else {
    it0 = blockIdx.x * steps;
    it1 = it0 + steps;
  }

  // x's copies: a thread's XIT copies a step are rows rr0 + it * RSTEP with the same 8
  // inputs q8 (their addresses worked out once a tile: the per-unit index math was ~a
  // quarter of a step's instructions in the SASS)
  constexpr int XIT = XU / NTH;
  constexpr int RSTEP = NTH / 16;
  static_assert(XU % NTH == 0 && NTH % 16 == 0, "x copies a thread");
  const int q8 = threadIdx.x & 15, rr0 = threadIdx.x >> 4;
  const int64_t xstep = (int64_t)RSTEP * K;
  const uint32_t xdst0 = static_cast<uint32_t>(__cvta_generic_to_shared(xs));
  // step ks of x into buffer st: unit u = row rr (u / 16) and inputs q * 8.. (q = u % 16,
  // lane t = q / 4's 32 inputs, pair hp = q % 4 of its MMA steps); rows past M are zeros
#define MB_STAGE(ks, st)                                                                   \
  _Pragma("unroll") for (int it = 0; it < XIT; ++it) {                                     \
    const int rr = rr0 + it * RSTEP;                                                       \
    const bool ok = (xok >> it) & 1u;                                                      \
    const T* src = ok ? xsrc0 + it * xstep + (ks) * 128 : x;                               \
    const int du = (st) * SSZ + (((rr >> 3) * 4 + (q8 & 3)) * 8 + (rr & 7)) * 4 + (q8 >> 2); \
    mb_cp16s(xdst0 + du * 16, src, ok);                                                    \
  }

  for (int wi = it0; wi < it1;) {
  // this pass: tile tl's k-steps k0..k1 - 1 (all of them but where stream-K cuts)
  const int tl = wi / steps;
  const int k0 = wi - tl * steps;
  const int k1 = min(steps, k0 + (it1 - wi));
  const bool first_pass = wi == it0;
  wi += k1 - k0;
  const int m0 = (tl % RC) * BM;
  // a warp's MT m-tiles are neighbours; each x fragment read feeds all of them
  const int tile0 = ((tl / RC) * WM + warp) * MT;
  // the weight row of MMA row r (0-15) of the warp's m-tile i; GLU: an m-tile is 8
  // gate rows (MMA rows 0-7) and their 8 up rows (8-15)
  auto wrow = [&](int i, int r) {
    const int fr = (tile0 + i) * (GLU ? 8 : 16) + (r & 7);
    return r < 8 ? fr : (GLU ? N + fr : fr + 8);
  };
  // lane (g, t)'s rows: g and g + 8 of each m-tile (GLU: the gate row and its up row)
  int row0[MT], row1[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    row0[i] = wrow(i, g);
    row1[i] = wrow(i, g + 8);
  }

  float c[MT][NTW][4];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        c[i][j][e] = 0.f;
      }
    }
  }

  const T* xsrc0 = x + (int64_t)(m0 + rr0) * K + q8 * 8;
  uint32_t xok = 0;
#pragma unroll
  for (int it = 0; it < XIT; ++it) {
    xok |= (m0 + rr0 + it * RSTEP < M ? 1u : 0u) << it;
  }

  // the rows' words and scale/bias pointers, once a tile (registers are not what
  // limits the blocks an SM: 2 of 4 warps at 169-255 registers)
  const uint32_t* wp0[MT];
  const uint32_t* wp1[MT];
  const T* sp0[MT];
  const T* sp1[MT];
  const T* bp0[MT];
  const T* bp1[MT];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    wp0[i] = w + (int64_t)row0[i] * words + t * 4;
    wp1[i] = w + (int64_t)row1[i] * words + t * 4;
    sp0[i] = scales + (int64_t)row0[i] * groups;
    sp1[i] = scales + (int64_t)row1[i] * groups;
    bp0[i] = biases + (int64_t)row0[i] * groups;
    bp1[i] = biases + (int64_t)row1[i] * groups;
  }
  // a step's weight words of rows row0/row1 of each m-tile (32 inputs: one quantization
  // group's part) and their groups' scale and bias, as pairs
  auto wload = [&](int ks, MbQw* dst) {
    const int gi = (ks * 128 + t * 32) / GS;
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      dst[i].q0 = mb_ldg(wp0[i] + ks * 16);
      dst[i].q1 = mb_ldg(wp1[i] + ks * 16);
      dst[i].sc0 = mb_pair(sp0[i][gi]);
      dst[i].sc1 = mb_pair(sp1[i][gi]);
      dst[i].bi0 = mb_pair(bp0[i][gi]);
      dst[i].bi1 = mb_pair(bp1[i][gi]);
    }
  };

  // step ks's products from buffer st and the weight registers cur
  auto compute = [&](int st, const MbQw* cur) {
    const uint4* xb = xs + st * SSZ + lane;
#pragma unroll
    for (int hp = 0; hp < 4; ++hp) {
      // MMA steps 2hp and 2hp + 1: inputs 8hp..8hp+3 and 8hp+4..8hp+7 of the lane's 32
      uint32_t a[MT][8];
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        const uint32_t v0 = mb_word(cur[i].q0, hp), v1 = mb_word(cur[i].q1, hp);
        const uint32_t s0 = cur[i].sc0, s1 = cur[i].sc1, b0 = cur[i].bi0, b1 = cur[i].bi1;
        a[i][0] = mb_deq2(v0, s0, b0, T{});
        a[i][1] = mb_deq2(v1, s1, b1, T{});
        a[i][2] = mb_deq2(v0 >> 8, s0, b0, T{});
        a[i][3] = mb_deq2(v1 >> 8, s1, b1, T{});
        a[i][4] = mb_deq2(v0 >> 16, s0, b0, T{});
        a[i][5] = mb_deq2(v1 >> 16, s1, b1, T{});
        a[i][6] = mb_deq2(v0 >> 24, s0, b0, T{});
        a[i][7] = mb_deq2(v1 >> 24, s1, b1, T{});
      }
#pragma unroll
      for (int j = 0; j < NTW; ++j) {
        const uint4 xv = xb[(j * 4 + hp) * 32];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          mb_mma(c[i][j], a[i][0], a[i][1], a[i][2], a[i][3], xv.x, xv.y, T{});
          mb_mma(c[i][j], a[i][4], a[i][5], a[i][6], a[i][7], xv.z, xv.w, T{});
        }
      }
    }
  };

  {
    // ST buffers of x: step ks + ST - 1's copy is issued while step ks is computed, and
    // each warp's weight words (registers) are loaded as many steps ahead
    MbQw cur[MT], nxt[MT], nn[MT];
    MB_STAGE(k0, 0)
    mb_commit();
    wload(k0, cur);
#pragma unroll
    for (int i = 0; i < MT; ++i) {
      nxt[i] = cur[i];
      nn[i] = cur[i];
    }
    if constexpr (ST == 3) {
      if (k0 + 1 < k1) {
        MB_STAGE(k0 + 1, 1)
        wload(k0 + 1, nxt);
      }
      mb_commit();
    }
    for (int ks = k0; ks < k1; ++ks) {
      const int st = (ks - k0) % ST;
      if (ks + ST - 1 < k1) {
        MB_STAGE(ks + ST - 1, (ks - k0 + ST - 1) % ST)
        if constexpr (ST == 3) {
          wload(ks + 2, nn);
        } else {
          wload(ks + 1, nxt);
        }
      }
      mb_commit();
      mb_wait<ST - 1>();  // this thread's copies of step ks are in (later ones may not be)
      __syncthreads();  // and everyone's
      compute(st, cur);
      __syncthreads();  // buffer st is free for step ks + ST (or the next pass)
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        cur[i] = nxt[i];
        if constexpr (ST == 3) {
          nxt[i] = nn[i];
        }
      }
    }
  }

  if constexpr (SK) {
    if (k0 != 0 || k1 != steps) {
      // a part of a tile: this pass's sums into the block's partial (slot 0 its first
      // pass, 1 its last), value-major so that a warp's stores are contiguous; the last
      // of the tile's blocks (counted on cnt[tl], zero between launches) sums every
      // block's partial in block order (the same sum whichever finishes last)
      constexpr int V = MT * NTW * 4;
      float* mine = const_cast<float*>(wsp) +
          (static_cast<int64_t>(blockIdx.x) * 2 + (first_pass ? 0 : 1)) * (V * NTH) + threadIdx.x;
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            mine[((i * NTW + j) * 4 + e) * NTH] = c[i][j][e];
          }
        }
      }
      // the tile's blocks: the owners of its first and last items (the owner of item
      // x is the last block whose share starts at or before it)
      const int64_t P = gridDim.x;
      const int64_t x0 = static_cast<int64_t>(tl) * steps;
      const int b0 = static_cast<int>(((x0 + 1) * P - 1) / items);
      const int b1 = static_cast<int>(((x0 + steps) * P - 1) / items);
      if (!mb_last_of(const_cast<int*>(cnt) + tl, b1 - b0 + 1)) {
        continue;
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int j = 0; j < NTW; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            c[i][j][e] = 0.f;
          }
        }
      }
      for (int bb = b0; bb <= b1; ++bb) {
        // block bb's part of this tile is its first pass if its share starts in it
        const int64_t sb = items * bb / P;
        const float* part = wsp + (static_cast<int64_t>(bb) * 2 + (sb / steps == tl ? 0 : 1)) * (V * NTH) +
            threadIdx.x;
#pragma unroll
        for (int i = 0; i < MT; ++i) {
#pragma unroll
          for (int j = 0; j < NTW; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              c[i][j][e] += __ldcg(part + ((i * NTW + j) * 4 + e) * NTH);
            }
          }
        }
      }
    }
  }

  // lane (g, t) holds weight rows g / g + 8 (c[i][.][0..1] / c[i][.][2..3]) of m-tile i,
  // x rows j * 8 + 2t and 2t + 1
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int j = 0; j < NTW; ++j) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int m = m0 + j * 8 + 2 * t + e;
        if (m < M) {
          if constexpr (GLU) {
            const float gs = c[i][j][e], us = c[i][j][2 + e];
            y[(int64_t)m * N + row0[i]] = static_cast<T>(gs / (1.f + __expf(-gs)) * us);
          } else {
            float v0 = c[i][j][e], v1 = c[i][j][2 + e];
            if constexpr (RES) {
              v0 += static_cast<float>(r[(int64_t)m * N + row0[i]]);
              v1 += static_cast<float>(r[(int64_t)m * N + row1[i]]);
            }
            y[(int64_t)m * N + row0[i]] = static_cast<T>(v0);
            y[(int64_t)m * N + row1[i]] = static_cast<T>(v1);
          }
        }
      }
    }
  }
  }  // the passes
#undef MB_STAGE
#undef MB_STAGE_W
