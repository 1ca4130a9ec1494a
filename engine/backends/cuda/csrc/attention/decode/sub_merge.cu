// engine/backends/cuda/attention/decode.py: _SUB_MERGE
// the warp's PW positions-at-once kept separate softmaxes: merged across the lanes that
// read the same dims (lane ^ LP, ^ 2LP, ...) before the block's warps are merged

  if constexpr (PW > 1) {
#pragma unroll
    for (int off = LP; off < 32; off <<= 1) {
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float mo = __shfl_xor_sync(0xffffffff, m[g], off);
        const float lo = __shfl_xor_sync(0xffffffff, l[g], off);
        const float mx = fmaxf(m[g], mo);
        const float c1 = mx == -INFINITY ? 0.f : expf(m[g] - mx);
        const float c2 = mx == -INFINITY ? 0.f : expf(mo - mx);
        l[g] = l[g] * c1 + lo * c2;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
          const float ao = __shfl_xor_sync(0xffffffff, acc[g][i], off);
          acc[g][i] = acc[g][i] * c1 + ao * c2;
        }
        m[g] = mx;
      }
    }
  }
