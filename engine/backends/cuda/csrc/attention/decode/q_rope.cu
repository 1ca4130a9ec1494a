// engine/backends/cuda/attention/decode.py: _Q_ROPE
// The append form: q, k and v of the new position (t_len - 1) come straight from the
// row's qkv product and get their RoPE here (MLX's formula: angle = scale * position *
// inv_freq, rounded to T as MLX's rope writes it). The block whose time range holds
// the new position writes its k and v into the cache buffer behind keys/values (an
// input: MLX orders it by the stream, see decode_attention_append) and takes that
// position into the softmax from registers, so no block reads the slot being written.

  const int t_new = t_len - 1;
  const int t_end = min(t1, t_new);
  const bool owner = t0 <= t_new && t_new < t1;
  const int nq = n_kv * G * HD;
  const T* xb = qkv + b * qkv_strides[0];
  const float pos_f = MB_ROPE_SCALE * static_cast<float>(pos[b]);
  float cs[PER];
  float sn[PER];
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    const int d = sl * PER + i;
    const float th = pos_f * inv_freq[TRAD ? d / 2 : d % (HD / 2)];
    cs[i] = cosf(th);
    sn[i] = sinf(th);
  }
  auto rope = [&](const T* src, float* out) {
    float x[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      x[i] = static_cast<float>(src[sl * PER + i]);
    }
    if (TRAD) {
#pragma unroll
      for (int i = 0; i + 1 < PER; i += 2) {
        out[i] = x[i] * cs[i] - x[i + 1] * sn[i];
        out[i + 1] = x[i] * sn[i] + x[i + 1] * cs[i];
      }
    } else {
      // dims d and d + HD/2 pair up: lanes sl and sl + LP/2 of the same position
#pragma unroll
      for (int i = 0; i < PER; ++i) {
        const float p = __shfl_xor_sync(0xffffffff, x[i], LP / 2);
        out[i] = sl < LP / 2 ? x[i] * cs[i] - p * sn[i] : p * sn[i] + x[i] * cs[i];
      }
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      out[i] = static_cast<float>(static_cast<T>(out[i]));
    }
  };
#pragma unroll
  for (int g = 0; g < G; ++g) {
    rope(xb + (hkv * G + g) * HD, qr[g]);
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      qr[g][i] *= MB_SCALE;
    }
  }
  float kn[PER];
  float vn[PER];
  rope(xb + nq + hkv * HD, kn);
#pragma unroll
  for (int i = 0; i < PER; ++i) {
    vn[i] = static_cast<float>(xb[nq + n_kv * HD + hkv * HD + sl * PER + i]);
  }
  if (owner && warp == 0 && sub == 0) {
    T* kw = const_cast<T*>(kb) + t_new * ts_k;
    T* vw = const_cast<T*>(vb) + t_new * ts_v;
#pragma unroll
    for (int i = 0; i < PER; ++i) {
      kw[i] = static_cast<T>(kn[i]);
      vw[i] = static_cast<T>(vn[i]);
    }
  }
