// engine/backends/cuda/attention/decode.py: _MERGE_SPLITS
// The splits' partial softmaxes of one (row, query head) merged, for dim d: by the merge
// kernel (two-pass) and by the last block of a split (one-pass). Read through L2
// (``__ldcg``): in the one-pass form the partials are other blocks' writes.

template <int HD>
__device__ __forceinline__ float mb_merge_splits(
    const float* pm, const float* pl, const float* pacc, int64_t row, int S, int d) {
  const int64_t r0 = row * S;
  float M = -INFINITY;
  for (int s = 0; s < S; ++s) {
    M = fmaxf(M, __ldcg(pm + r0 + s));
  }
  float L = 0.f;
  float A = 0.f;
  for (int s = 0; s < S; ++s) {
    const float mw = __ldcg(pm + r0 + s);
    if (mw != -INFINITY) {
      const float e = expf(mw - M);
      L += __ldcg(pl + r0 + s) * e;
      A += __ldcg(pacc + (r0 + s) * HD + d) * e;
    }
  }
  return A / L;
}
