// engine/backends/cuda/attention/decode.py: _NEW_POSITION
// the append form's new position, by one warp of the block that owns it (the block's
// warps are merged next, so any warp may take it)

  if (owner && warp == WARPS - 1) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
      float d = 0.f;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        d += qr[g][i] * kn[i];
      }
#pragma unroll
      for (int off = LP / 2; off > 0; off >>= 1) {
        d += __shfl_xor_sync(0xffffffff, d, off);
      }
      if (sub != 0) {
        continue;  // the warp's other positions take it in when they merge
      }
      const float mx = fmaxf(m[g], d);
      const float corr = expf(m[g] - mx);
      const float p = expf(d - mx);
      l[g] = l[g] * corr + p;
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        acc[g][i] = acc[g][i] * corr + p * vn[i];
      }
      m[g] = mx;
    }
  }
