"""What the decode attention's two kernels share: the append form's inputs (both take
the fused q/k/v product before RoPE and the cache buffers), so that neither module
imports the other's private names."""

CACHE_INPUTS = [("keys", "T", 4), ("values", "T", 4), ("start", "int32", 1)]
# the append form's inputs: the q/k/v product [B, (Hq + 2 Hkv) * D], the cache, each
# row's position and the RoPE's inverse frequencies
APPEND_INPUTS = [("qkv", "T", 2), *CACHE_INPUTS, ("pos", "int32", 1), ("inv_freq", "float32", 1)]
