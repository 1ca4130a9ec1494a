// engine/backends/cuda/attention/decode.py: _SETUP

  constexpr int PER = HD / LP;  // a lane's values of one position
  constexpr int PW = 32 / LP;  // positions a warp loads at once (one per LP lanes)
  constexpr int WORDS = (PER * static_cast<int>(sizeof(T)) + 3) / 4;
  const int split = blockIdx.x;
  const int hkv = blockIdx.y;
  const int b = blockIdx.z;
  const int nsplit = gridDim.x;
  const int n_kv = gridDim.y;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int sub = lane / LP;  // which of the warp's PW positions this lane reads
  const int sl = lane % LP;   // which PER values of it
  const int row0 = start[b];
  const int t_len = MB_T_LEN;
  const int valid = t_len - row0;
  const int chunk = (valid + nsplit - 1) / nsplit;
  const int t0 = row0 + split * chunk;
  const int t1 = min(t_len, t0 + chunk);
  const T* kb = keys + b * keys_strides[0] + hkv * keys_strides[1] + sl * PER;
  const T* vb = values + b * values_strides[0] + hkv * values_strides[1] + sl * PER;
  const int64_t ts_k = keys_strides[2];
  const int64_t ts_v = values_strides[2];
  float qr[G][PER];
