// engine/backends/cuda/attention/decode.py: _MERGE_LAST
// The split forms in one kernel: after writing its partial softmax, each block counts
// itself done on its (row, KV head)'s counter; the last one merges the splits (the
// merge kernel's work) and sets the counter back to 0 for the next launch. The counter
// array is an input that stays zero between launches (``_counters``); the partials are
// read through L2 (``__ldcg``: another block's writes, made visible by its fence).

  if (!mb_last_of(const_cast<int*>(counter) + b * n_kv + hkv, nsplit)) {
    return;
  }
  for (int idx = threadIdx.x; idx < G * HD; idx += WARPS * 32) {
    const int g = idx / HD;
    const int d = idx % HD;
    const int64_t row = static_cast<int64_t>(b) * n_kv * G + hkv * G + g;
    out[row * HD + d] = static_cast<T>(mb_merge_splits<HD>(pm, pl, pacc, row, nsplit, d));
  }
