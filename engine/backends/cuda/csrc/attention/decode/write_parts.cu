// engine/backends/cuda/attention/decode.py: _WRITE_PARTS

    const int64_t r = row * nsplit + split;
    pacc[r * HD + d] = A;
    if (d == 0) {
      pm[r] = M;
      pl[r] = L;
    }
  }
