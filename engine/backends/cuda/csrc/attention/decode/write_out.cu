// engine/backends/cuda/attention/decode.py: _WRITE_OUT

    out[row * HD + d] = static_cast<T>(A / L);
  }
