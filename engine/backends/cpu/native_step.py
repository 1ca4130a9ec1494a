"""The llama and Gemma 3 decode step as one C call (native/decode_step.c).

Why: the lean step (step.py) still spends most of a small model's one-row step
outside its products: ~30 MLX nodes a layer at ~5 us of dispatch each, Python building
the graph on one of the two cores while the products' helper thread wants it, and that
helper sleeping between products. The C step runs the whole forward (norms, RoPE, the
KV write, attention, SwiGLU, residuals, the output layer) on the calling thread with the
interpreter's lock released; its products are the shim's own (the weight's quantized
copy found by address, the same kernel and pool as the lean step's matmuls: the same
bits), and its attention takes the shim's score product with the softmax inside and its
small value product, one (row, KV head) at a time, each row over its own keys only.

What stays in MLX: the RoPE factors (the lean step's tables, made from the model's own
rope module, so every rope variant mlx-lm builds stays exact; made for 256 positions at
a time and kept) and the caches' bookkeeping (``BatchKV.reserve``: the C step writes the new token's keys and values into
the buffers it returns, at the time index the batch reserved). Values equal the lean
step's to float32 rounding (tests/backends/cpu/test_cpu_native_step.py).

Used for llama and Gemma 3 layers (``layer_form`` "llama" / "gemma3": Gemma 3's
sandwich norms, query/key head norms, GELU-tanh MLP, its sliding layers' window and
their own RoPE base) with float32 weights; Gemma 2 (soft caps) keeps the lean step, and
a batch whose caches are not the engine's ``BatchKV`` goes through the lean step it wraps.
"""

from __future__ import annotations

import ctypes
import logging

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models import gemma3_text

from engine.backends.cpu import blas
from engine.backends.cpu.step import CpuDecodeStep, _Unsupported
from engine.kv import BatchKV

log = logging.getLogger("markbase.cpu_native_step")


# RoPE factors are made for this many positions at a time, and kept for this many
# such chunks per RoPE setting (at most ~16 MB for Gemma 3's head_dim of 256)
_CHUNK = 256
_CHUNKS_KEPT = 32


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("mlp_norm", ctypes.c_void_p),
        ("w_qkv", ctypes.c_void_p),
        ("w_o", ctypes.c_void_p),
        ("w_gu", ctypes.c_void_p),
        ("w_down", ctypes.c_void_p),
        ("k", ctypes.c_void_p),
        ("v", ctypes.c_void_p),
        ("kb", ctypes.c_long),
        ("kh", ctypes.c_long),
        ("kt", ctypes.c_long),
        ("vb", ctypes.c_long),
        ("vh", ctypes.c_long),
        ("vt", ctypes.c_long),
        ("start", ctypes.c_void_p),
        ("t_new", ctypes.c_int),
        ("rope", ctypes.c_int),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("post_attn_norm", ctypes.c_void_p),
        ("post_mlp_norm", ctypes.c_void_p),
    ]


class _Step(ctypes.Structure):
    _fields_ = [
        *[
            (n, ctypes.c_int)
            for n in ("B", "D", "n_heads", "n_kv", "head_dim", "inter", "vocab", "n_layers")
        ],
        ("traditional", ctypes.c_int),
        ("n_embed", ctypes.c_int),
        ("gemma", ctypes.c_int),
        ("eps", ctypes.c_float),
        ("embed_scale", ctypes.c_float),
        ("embed", ctypes.c_void_p),
        ("final_norm", ctypes.c_void_p),
        ("head_w", ctypes.c_void_p),
        ("tokens", ctypes.c_void_p),
        ("scale", ctypes.c_float),
        ("cs", ctypes.c_void_p * 2),
        ("sn", ctypes.c_void_p * 2),
        ("logits", ctypes.c_void_p),
        ("layers", ctypes.POINTER(_Layer)),
    ]


def _view(a: mx.array) -> np.ndarray:
    """The evaluated array's own memory as numpy (no copy)."""
    return np.asarray(memoryview(a))


def _address(a: mx.array) -> tuple[int, tuple[int, int, int]]:
    """An evaluated float32 [B, H, T, D] buffer's address and its row, head and time
    strides in floats (D contiguous): what the C step indexes the KV buffers by."""
    mv = memoryview(a)
    if mv.format != "f" or mv.strides[3] != 4:
        raise RuntimeError("the C decode step needs float32 KV rows")
    b, h, t, _ = (x // 4 for x in mv.strides)
    return ctypes.addressof(ctypes.c_char.from_buffer(mv)), (b, h, t)


def _weight_ptr(w_t: mx.array) -> int:
    """Address of the row-major [N, K] weight behind a transposed view [K, N]."""
    n = _view(w_t).T
    if n.dtype != np.float32 or not n.flags.c_contiguous:
        raise _Unsupported("a weight is not a row-major float32 matrix")
    return n.ctypes.data


def _vector_ptr(a: mx.array, keep: list) -> int:
    n = np.ascontiguousarray(_view(a), dtype=np.float32)
    keep.append(n)
    return n.ctypes.data


class NativeDecodeStep:
    """``step(tokens [B, 1] int32, cache) -> logits [B, V]`` through one C call;
    ``build`` returns the lean step instead when the model's layers are not llama's or
    Gemma 3's, or the shim lacks the C step."""

    @classmethod
    def build(cls, model):
        lean = CpuDecodeStep.build(model)
        if lean is None:
            return None
        try:
            return cls(lean)
        except _Unsupported as exc:
            log.info("C decode step not used: %s", exc)
            return lean

    def __init__(self, lean: CpuDecodeStep) -> None:
        lib = blas.shim_library()
        if lib is None or not hasattr(lib, "markbase_decode_step"):
            raise _Unsupported("the sgemm shim is not loaded")
        if lean.family not in ("llama", "gemma3"):
            raise _Unsupported(f"{lean.family} layers")
        if lean._softmax_alpha is None:
            raise _Unsupported("MLX's matmuls do not reach the shim")
        if len(lean._ropes) > 2:
            raise _Unsupported("more than two RoPE settings")
        if lean.head_dim > 512:
            raise _Unsupported(f"head_dim {lean.head_dim} (at most 512)")
        self.lean = lean
        self.gemma = lean.family == "gemma3"
        self._fn = lib.markbase_decode_step
        self._fn.argtypes = [ctypes.POINTER(_Step)]
        self._fn.restype = ctypes.c_int
        inner = lean.inner
        embed = inner.embed_tokens
        if type(embed) is not nn.Embedding or embed.weight.dtype != mx.float32:
            raise _Unsupported("the embedding is not a float32 nn.Embedding")
        self._keep: list = [lean._wt]  # the arrays whose memory the C step reads
        norm_type = gemma3_text.RMSNorm if self.gemma else nn.RMSNorm
        eps: set[float] = set()

        def norm(module) -> int:
            """The norm's weight as the C step applies it (Gemma's: 1 + w)."""
            if type(module) is not norm_type or module.weight.dtype != mx.float32:
                raise _Unsupported(f"a norm is not a float32 {norm_type.__name__}")
            eps.add(float(module.eps))
            w = 1.0 + module.weight if self.gemma else module.weight
            mx.eval(w)
            return _vector_ptr(w, self._keep)

        self._layers = (_Layer * len(inner.layers))()
        for i, (layer, w) in enumerate(zip(inner.layers, lean._wt)):
            L = self._layers[i]
            L.attn_norm = norm(layer.input_layernorm)
            L.w_qkv, L.w_o = _weight_ptr(w["qkv"]), _weight_ptr(w["o"])
            L.w_gu, L.w_down = _weight_ptr(w["gate_up"]), _weight_ptr(w["down"])
            L.rope = lean._rope_of[i]
            if self.gemma:
                L.mlp_norm = norm(layer.pre_feedforward_layernorm)
                L.q_norm = norm(layer.self_attn.q_norm)
                L.k_norm = norm(layer.self_attn.k_norm)
                L.post_attn_norm = norm(layer.post_attention_layernorm)
                L.post_mlp_norm = norm(layer.post_feedforward_layernorm)
            else:
                L.mlp_norm = norm(layer.post_attention_layernorm)
        s = self._s = _Step()
        s.final_norm = norm(inner.norm)
        if len(eps) != 1:
            raise _Unsupported("norms with different eps")
        s.eps = eps.pop()
        s.D = int(embed.weight.shape[1])
        s.n_heads, s.n_kv, s.head_dim = lean.n_heads, lean.n_kv, lean.head_dim
        s.inter = int(lean._wt[0]["gate_up"].shape[1]) // 2
        s.vocab = int(lean._head_wt.shape[1])
        s.n_layers = len(inner.layers)
        s.traditional = int(lean.traditional)
        s.n_embed = int(embed.weight.shape[0])
        s.gemma = int(self.gemma)
        s.embed_scale = float(lean._embed_scale.astype(mx.float32).item()) if self.gemma else 1.0
        s.embed = _vector_ptr(embed.weight, self._keep)
        s.head_w = _weight_ptr(lean._head_wt)
        s.scale = lean.scale
        s.layers = self._layers
        log.info("C decode step: %d %s layers", s.n_layers, lean.family)
        # the window of Gemma 3's sliding layers, as the lean step masks them
        self._window = [lean.window if w else None for w in lean._sliding]
        # per RoPE setting: chunk index -> (cos, sin) [_CHUNK, head_dim] of its positions
        self._factors: list[dict[int, tuple[np.ndarray, np.ndarray]]] = [{} for _ in lean._ropes]

    def _rope_factors(self, which: int, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Each row's RoPE cos and sin factors [B, head_dim] for RoPE setting ``which``:
        the lean step's tables (the model's own rope module applied to probe vectors)
        at those positions, made for a chunk of positions at a time and kept for the
        chunks in use (an MLX evaluation per ``_CHUNK`` steps instead of every step)."""
        chunks = self._factors[which]
        for c in {p // _CHUNK for p in positions} - chunks.keys():
            if len(chunks) >= _CHUNKS_KEPT:
                chunks.pop(next(iter(chunks)))  # the oldest
            lean, nq, hd = self.lean, self.lean.nq, self.lean.head_dim
            pos = mx.arange(c * _CHUNK, (c + 1) * _CHUNK, dtype=mx.int32)
            cos, sin = lean._tables(pos, _CHUNK, lean._ropes[which])
            cos = cos.reshape(_CHUNK, -1)[:, nq : nq + hd]  # a key head's (unscaled)
            sin = sin.reshape(_CHUNK, -1)[:, nq : nq + hd]
            mx.eval(cos, sin)
            chunks[c] = (np.array(cos, dtype=np.float32), np.array(sin, dtype=np.float32))
        cos = np.stack([chunks[p // _CHUNK][0][p % _CHUNK] for p in positions])
        sin = np.stack([chunks[p // _CHUNK][1][p % _CHUNK] for p in positions])
        return cos, sin

    def _fits(self, kvs: list, b: int) -> bool:
        """Batch caches of the layers' own kinds, every row in each (what the C step
        indexes)."""
        if len(kvs) != self._s.n_layers or b == 0:
            return False
        return all(
            type(kv) is BatchKV
            and kv.keys is not None
            and kv.batch_size == b
            and (kv.window is None or self._window[i] is not None)
            for i, kv in enumerate(kvs)
        )

    def __call__(self, tokens, cache):
        b = tokens.shape[0]
        kvs = list(cache)
        if not self._fits(kvs, b):
            return self.lean(tokens, cache)
        s = self._s
        positions = kvs[0].positions()  # before the reserve below moves them
        factors = [self._rope_factors(i, positions) for i in range(len(self._factors))]
        # each layer's new time index and its rows' first visible one (a sliding
        # layer's rows see the last ``window`` positions: the lean step's mask)
        starts: dict[tuple, np.ndarray] = {}
        pad0 = kvs[0].pad
        for i, kv in enumerate(kvs):
            t_new, window = kv.length, self._window[i]
            key = (t_new, window, None if kv.pad == pad0 else tuple(kv.pad))
            if key not in starts:
                start = np.asarray(kv.pad, dtype=np.int32)
                if window is not None:
                    start = np.maximum(start, t_new + 1 - window).astype(np.int32)
                starts[key] = start
            L = self._layers[i]
            L.t_new, L.start = t_new, starts[key].ctypes.data
        bufs = [kv.reserve(1, views=False) for kv in kvs]
        mx.eval(tokens, bufs)
        tok = np.ascontiguousarray(_view(tokens).reshape(b), dtype=np.int32)
        for i, (k, v) in enumerate(bufs):
            L = self._layers[i]
            L.k, (L.kb, L.kh, L.kt) = _address(k)
            L.v, (L.vb, L.vh, L.vt) = _address(v)
        logits = np.empty((b, s.vocab), dtype=np.float32)
        s.B, s.tokens, s.logits = b, tok.ctypes.data, logits.ctypes.data
        for i, (cos, sin) in enumerate(factors):
            s.cs[i], s.sn[i] = cos.ctypes.data, sin.ctypes.data
        rc = self._fn(ctypes.byref(s))
        if rc != 0:
            why = {-2: "out of memory", -3: "a token id outside the embedding"}.get(rc, rc)
            raise RuntimeError(f"the C decode step failed: {why}")
        return mx.array(logits)
