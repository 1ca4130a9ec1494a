"""The decode step on MLX's CPU backend, written for few graph nodes.

Why: on a CPU every MLX primitive costs ~5 µs of dispatch whatever its size
(measured: 700 chained adds on a [1, 576] array take 3.8 ms), and a decode step of
a small model is mostly such overhead. ``FusedDecodeStep`` (engine/model/decode_step.py)
still built ~2,170 nodes per SmolLM2-135M step, 72 per layer: MLX's CPU RoPE is a
fallback of ~15 ops (arange, cos, sin, concatenate ...) run for Q and for K in every
layer, and transposes/astype that a one-token step does not need.

This step builds ~30 nodes per layer:

- RoPE tables once per step, not per layer: the layer's own rope module is applied
  to two probe vectors at every row's position, which gives, for each element, the
  factors of ``rope(x) = x * C + swap(x) * S`` (``swap`` exchanges the two members
  of each rotated pair: neighbours for "traditional" RoPE, the two halves of a head
  otherwise). Any rope variant mlx-lm builds (scaled, Llama 3, YaRN, SuScaled) is
  linear per pair, so this is exact; the tables are checked against the module at
  construction and the step is not used when they disagree.
- One table covers the fused Q|K|V output: C = scale * cos over the query part (the
  attention scale folded in), cos over the keys, 1 over the values (S = 0), so RoPE
  for the whole layer is one fused elementwise kernel after the QKV matmul.
- Reshapes instead of transposes (one query position per row), and the MLP of
  layer i compiled together with the norm, QKV product and RoPE of layer i + 1.
- SiLU from engine/backends/cpu/fast_math.py (MLX's CPU exp is ~15x slower than its multiplies:
  ~14 ms of a batch-16 step). The attention's masked softmax runs inside its score
  product when MLX's matmuls reach the sgemm shim (``mx.addmm`` with the shim's
  softmax alpha: engine/backends/cpu/native/blas_shim.c): MLX's CPU softmax runs its exp
  one element at a time, ~28 ms of a batch-16 step. Soft-capped scores (Gemma 2) keep
  MLX's softmax.

The KV update and the attention stay outside ``mx.compile`` (they touch the cache
object); the attention is the grouped-query form of engine/model/attention.py. Values
equal ``FusedDecodeStep``'s to float32 rounding (tests/backends/cpu/test_cpu_step.py).

Two layer forms, each written as its mlx-lm module computes it:

- llama (``mlx_lm.models.llama``): pre-norm attention and SwiGLU MLP, each added to
  the residual stream inside the product (``addmm``).
- Gemma 3 (``mlx_lm.models.gemma3_text``): the embedding scaled by sqrt(hidden), the
  (1 + w) RMSNorms before and after both the attention and the MLP, RMSNorms over
  each query and key head before RoPE, a GELU-tanh MLP, and sliding-window layers
  between global ones (their own RoPE base, and the window mask of their own cache,
  which keeps about the window's keys: engine/kv.py); one RoPE table pair per distinct
  rope module and one mask per kind of layer.
- Gemma 2 (``mlx_lm.models.gemma2``): Gemma 3's sandwich norms and GELU-tanh MLP,
  without the query/key norms and sliding windows (mlx-lm's gemma2 attends to every
  position), with the attention scores and the output logits soft-capped
  (``cap * tanh(x / cap)``).
"""

from __future__ import annotations

import logging

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gemma2, gemma3_text, llama

from engine.backends.cpu import fast_math
from engine.backends.cpu.attention import softmax_alpha
from engine.model.decode_step import fuse_linears

log = logging.getLogger("markbase.cpu_step")

# Every this many layers the step queues what it has built so far (``mx.async_eval``):
# MLX's CPU stream then runs those layers while Python builds the next ones, instead
# of starting only when the whole graph is built (~2.5 ms of Python for SmolLM2-135M's
# 30 layers). SmolLM2's step, 256 positions, alternated in one process on 2 Zen 3
# cores: 1.05x at B=1, 1.03x at B=4, 1.01x at B=8 (every layer: 1.04x / 1.02-1.07x /
# 0.99x at B=16; every 6: 1.05x / 1.02x / 1.01x).
_QUEUE_EVERY = 3


class CpuDecodeStep:
    """``step(tokens [B, 1] int32, cache) -> logits [B, V]`` (lazy) for llama-family
    models on the CPU; ``build`` returns None when the model does not fit it."""

    @classmethod
    def build(cls, model) -> CpuDecodeStep | None:
        try:
            step = cls(model)
        except _Unsupported as exc:
            log.info("lean CPU decode step not used: %s", exc)
            return None
        return step

    def __init__(self, model) -> None:
        self.model = model
        self.family = layer_form(model)
        self.gemma = self.family in ("gemma3", "gemma2")  # the sandwich norms, GELU MLP
        self.inner = inner = model.model
        layers = inner.layers
        attn = layers[0].self_attn
        self.n_heads, self.n_kv, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.nq = self.n_heads * self.head_dim
        self.nk = self.n_kv * self.head_dim
        self.scale = float(attn.scale)
        # one RoPE table pair per distinct rope module setting (Gemma 3: the sliding
        # layers' local base and the global layers' base); every layer's index into them
        self._ropes: list = []
        self._rope_of: list[int] = []
        for layer in layers:
            key = _rope_settings(layer.self_attn.rope)
            known = [_rope_settings(r) for r in self._ropes]
            if key not in known:
                self._ropes.append(layer.self_attn.rope)
                known.append(key)
            self._rope_of.append(known.index(key))
        traditional = {bool(getattr(r, "traditional", False)) for r in self._ropes}
        if len(traditional) != 1:
            raise _Unsupported("layers mix traditional and split-half RoPE")
        self.traditional = traditional.pop()
        for rope in self._ropes:
            dims = getattr(rope, "dims", self.head_dim)
            if dims != self.head_dim and not self.traditional:
                raise _Unsupported(f"partial RoPE ({dims} of {self.head_dim} dims)")
        if self.head_dim % 2:
            raise _Unsupported("odd head_dim")
        # Gemma 3: which layers attend through the sliding window (the model's own rule)
        self.window = None
        self._sliding = [False] * len(layers)
        if self.family == "gemma3":
            pattern = inner.sliding_window_pattern
            self.window = int(inner.window_size)
            self._sliding = [i % pattern != pattern - 1 for i in range(len(layers))]
            self._embed_scale = mx.array(inner.args.hidden_size**0.5, mx.bfloat16)
        # Gemma 2: the embedding scaled in float32, soft-capped scores and logits
        self._score_cap = self._logit_cap = None
        if self.family == "gemma2":
            self._embed_scale = mx.array(inner.args.hidden_size**0.5, mx.float32)
            self._score_cap = float(attn.attn_logit_softcapping)
            self._logit_cap = float(model.final_logit_softcapping)
        # the first layer of each kind, whose cache gives that kind's mask
        self._global_at = next((i for i, w in enumerate(self._sliding) if not w), None)
        self._sliding_at = next((i for i, w in enumerate(self._sliding) if w), None)
        for layer in layers:
            a = layer.self_attn
            if (a.n_heads, a.n_kv_heads, a.head_dim, a.scale) != (
                self.n_heads,
                self.n_kv,
                self.head_dim,
                attn.scale,
            ):
                raise _Unsupported("layers differ in attention shape")
            if any("bias" in lin for lin in (a.q_proj, a.k_proj, a.v_proj, a.o_proj)):
                raise _Unsupported("projection biases")

        # Every weight as its transposed view [K, N], made once: inside mx.compile a
        # ``w.T`` would be a Transpose node in every step. The views share the weights'
        # memory, so the sgemm shim still finds them by address (engine/backends/cpu/qgemm.py).
        self._wt: list[dict[str, mx.array]] = []
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv = fuse_linears([a.q_proj, a.k_proj, a.v_proj])
            gu = fuse_linears([mlp.gate_proj, mlp.up_proj])
            if (
                qkv is None
                or gu is None
                or any(type(m) is not nn.Linear or "bias" in m for m in (a.o_proj, mlp.down_proj))
            ):
                raise _Unsupported("projections are not plain float nn.Linear layers")
            self._wt.append(
                {
                    "qkv": qkv.weight.T,
                    "o": a.o_proj.weight.T,
                    "gate_up": gu.weight.T,
                    "down": mlp.down_proj.weight.T,
                }
            )
        if hasattr(model, "tie_word_embeddings"):  # gemma3_text keeps the flag on the model
            tied = bool(model.tie_word_embeddings)
        else:
            tied = getattr(getattr(model, "args", None), "tie_word_embeddings", True)
        lm_head = getattr(model, "lm_head", None)
        if tied or lm_head is None:
            head_w = inner.embed_tokens.weight  # the tied embedding as the output layer
        elif type(lm_head) is nn.Linear and "bias" not in lm_head:
            head_w = lm_head.weight
        else:
            raise _Unsupported("the output layer is not a plain float nn.Linear")
        if head_w.dtype != self._wt[0]["qkv"].dtype:
            raise _Unsupported("the output layer's dtype differs from the layers'")
        self._head_wt = head_w.T
        mx.eval(self._head_wt, [list(w.values()) for w in self._wt])
        # which element of a rotated pair each dim is, and the two probe vectors
        # (constants: made once, not in every step's graph)
        idx = mx.arange(self.head_dim)
        self._first_member = (idx % 2 == 0) if self.traditional else (idx < self.head_dim // 2)
        first = self._first_member.astype(mx.float32)
        self._probe = mx.stack([first, 1 - first])[:, None, :]  # [2, 1, D]
        mx.eval(self._first_member, self._probe)
        self._check_rope(layers)
        # float32 scores without a soft cap: the softmax runs inside their product
        self._softmax_alpha = None
        if self._score_cap is None and self._head_wt.dtype == mx.float32:
            self._softmax_alpha = softmax_alpha()

        n = len(layers)
        # layer 0's input part; then "MLP of i + input part of i + 1"; the last MLP + head
        self._first = mx.compile(lambda x, c, s: self._pre(0, self._embedded(x), c, s))
        self._between = [
            mx.compile(lambda x, o, c, s, i=i: self._pre(i + 1, self._post(i, x, o), c, s))
            for i in range(n - 1)
        ]
        self._last = mx.compile(lambda x, o: self._head(self._post(n - 1, x, o)))

    # ---------------------------------------------------------------- the pieces
    # The hidden state is 2-D [B, D] throughout (one token per row): a 3-D operand
    # costs every matmul a Flatten and an Unflatten node.
    def _embedded(self, x):
        """The token embeddings as the model's body scales them (Gemma 3: by
        sqrt(hidden), rounded to bfloat16 as mlx-lm does; Gemma 2: in float32)."""
        if self.gemma:
            return x * self._embed_scale.astype(x.dtype)
        return x

    def _pre(self, i: int, x, c, s):
        """Norm, fused QKV product and RoPE (with the attention scale) of layer i
        (Gemma 3: the query and key heads RMS-normed before RoPE)."""
        layer = self.inner.layers[i]
        b = x.shape[0]
        qkv = layer.input_layernorm(x) @ self._wt[i]["qkv"]  # [B, Nq + 2 Nk]
        if self.family == "gemma3":
            attn = layer.self_attn
            q, k, v = mx.split(qkv, [self.nq, self.nq + self.nk], axis=-1)
            q = attn.q_norm(q.reshape(b, self.n_heads, self.head_dim)).reshape(b, -1)
            k = attn.k_norm(k.reshape(b, self.n_kv, self.head_dim)).reshape(b, -1)
            qkv = mx.concatenate([q, k, v], axis=-1)
        qkv = self._pairs(qkv)
        qkv = (qkv * c + self._swap(qkv) * s).reshape(b, -1)
        q, k, v = mx.split(qkv, [self.nq, self.nq + self.nk], axis=-1)
        q = q.reshape(b, self.n_kv, -1, self.head_dim)
        k = k.reshape(b, self.n_kv, 1, self.head_dim)
        v = v.reshape(b, self.n_kv, 1, self.head_dim)
        return x, q, k, v

    def _post(self, i: int, x, o):
        """Output projection, residual, norm, SwiGLU MLP, residual of layer i (Gemma 3:
        the sandwich norms and the GELU-tanh MLP)."""
        layer, w = self.inner.layers[i], self._wt[i]
        if self.gemma:
            add = _residual if self.family == "gemma3" else mx.add
            h = add(x, layer.post_attention_layernorm(o @ w["o"]))
            z = layer.pre_feedforward_layernorm(h) @ w["gate_up"]
            g, u = mx.split(z, 2, axis=-1)
            m = fast_math.gelu_tanh_mul(g, u) @ w["down"]
            return add(h, layer.post_feedforward_layernorm(m))
        h = mx.addmm(x, o, w["o"])  # x + o @ w: one BLAS call with beta = 1
        g, u = mx.split(layer.post_attention_layernorm(h) @ w["gate_up"], 2, axis=-1)
        return mx.addmm(h, fast_math.silu_mul(g, u), w["down"])

    def _head(self, x):
        out = self.inner.norm(x) @ self._head_wt
        if self._logit_cap is not None:
            out = mx.tanh(out / self._logit_cap) * self._logit_cap
        return out

    def _pairs(self, v):
        """[B, N] -> the shape in which ``_swap`` is one reversed axis."""
        b = v.shape[0]
        if self.traditional:
            return v.reshape(b, -1, 2)
        return v.reshape(b, -1, 2, self.head_dim // 2)

    def _swap(self, v):
        return v[..., ::-1] if self.traditional else v[..., ::-1, :]

    # ---------------------------------------------------------------- RoPE tables
    def _tables(self, offset, b: int, rope):
        """C and S over Q|K|V for rows at positions ``offset`` [B], in ``_pairs`` shape:
        the rope module applied to a unit pattern on the first member of every pair,
        then on the second, gives each element's C and S."""
        d = self.head_dim
        probe = mx.broadcast_to(self._probe, (b, 2, 1, d))
        r = rope(probe, offset=offset)  # [B, 2, 1, D]: the probes rotated
        first, second = r[:, 0, 0, :], r[:, 1, 0, :]
        cos = mx.where(self._first_member, first, second)  # [B, D]
        sin = mx.where(self._first_member, second, first)
        heads = self.n_heads + 2 * self.n_kv
        c = mx.concatenate(
            [
                mx.tile(cos * self.scale, (1, self.n_heads)),
                mx.tile(cos, (1, self.n_kv)),
                mx.ones((b, self.nk), dtype=cos.dtype),
            ],
            axis=-1,
        )
        s = mx.concatenate(
            [
                mx.tile(sin * self.scale, (1, self.n_heads)),
                mx.tile(sin, (1, self.n_kv)),
                mx.zeros((b, self.nk), dtype=sin.dtype),
            ],
            axis=-1,
        )
        assert c.shape[-1] == heads * d
        return self._pairs(c), self._pairs(s)

    def _check_rope(self, layers) -> None:
        """The tables must reproduce every layer's rope module exactly."""
        offsets = mx.array([0, 5, 301], dtype=mx.int32)
        x = mx.random.normal((3, self.n_heads, 1, self.head_dim), key=mx.random.key(7))
        tables = [self._tables(offsets, 3, rope) for rope in self._ropes]
        for layer, which in zip(layers, self._rope_of):
            c, s = tables[which]
            ref = layer.self_attn.rope(x, offset=offsets)
            # ours, applied to the query part of a Q|K|V vector (scale divided back out)
            v = mx.concatenate(
                [x.reshape(3, -1), mx.zeros((3, 2 * self.nk), dtype=x.dtype)], axis=-1
            )
            v = self._pairs(v)
            ours = (v * c + self._swap(v) * s).reshape(3, -1)[:, : self.nq] / self.scale
            err = mx.abs(ours.reshape(ref.shape) - ref).max().item()
            if not err < 1e-4:
                raise _Unsupported(f"RoPE tables differ from the model's rope by {err:.2e}")

    # ---------------------------------------------------------------- the step
    def __call__(self, tokens, cache):
        b = tokens.shape[0]
        x = self.inner.embed_tokens(tokens.reshape(b))  # [B, D]
        off = cache[0].offset
        offset = off if isinstance(off, mx.array) else mx.full((b,), off, dtype=mx.int32)
        tables = [self._tables(offset, b, rope) for rope in self._ropes]
        # None or additive [B, Hkv, G, T]: one for the global layers and one for the
        # sliding ones, each from a cache of its kind (a sliding layer's cache may keep
        # only its window's keys: engine/kv.py), as the model's own call asks for them
        mask = window_mask = None
        if self._global_at is not None:
            mask = self._additive(cache[self._global_at].make_mask(1), b, x.dtype)
        if self._sliding_at is not None:
            window_mask = cache[self._sliding_at].make_mask(1, window_size=self.window)
            window_mask = self._additive(window_mask, b, x.dtype)
        x, q, k, v = self._first(x, *tables[self._rope_of[0]])
        last = len(cache) - 1
        zeros: dict[int, mx.array] = {}  # the softmax's mask where a layer needs none
        for i, layer_kv in enumerate(cache):
            keys, values = layer_kv.update_and_fetch(k, v)
            # grouped-query attention (engine/model/attention.py's form); q is pre-scaled and
            # already grouped [B, Hkv, G, D]
            m = window_mask if self._sliding[i] else mask
            if self._softmax_alpha is not None:
                # the masked softmax inside the score product (native/blas_shim.c)
                t = keys.shape[2]
                if m is None and t not in zeros:
                    zeros[t] = mx.zeros((b, self.n_kv, self.n_heads // self.n_kv, t), x.dtype)
                c = zeros[t] if m is None else m
                probs = mx.addmm(c, q, keys.swapaxes(-1, -2), alpha=self._softmax_alpha, beta=1.0)
                o = (probs @ values).reshape(b, -1)
            else:
                scores = q @ keys.swapaxes(-1, -2)
                if self._score_cap is not None:
                    scores = mx.tanh(scores / self._score_cap) * self._score_cap
                if m is not None:
                    scores = scores + m
                o = (mx.softmax(scores, axis=-1, precise=True) @ values).reshape(b, -1)
            if i < last:
                x, q, k, v = self._between[i](x, o, *tables[self._rope_of[i + 1]])
                if i % _QUEUE_EVERY == _QUEUE_EVERY - 1:
                    mx.async_eval(x, q, k, v)
            else:
                return self._last(x, o)
        raise AssertionError("no layers")

    def _additive(self, mask, b: int, dtype):
        """A boolean [B, 1, 1, T] mask as additive and already broadcast to the scores'
        shape (one Add per layer); None stays None."""
        if mask is None:
            return None
        g = self.n_heads // self.n_kv
        mask = mx.where(mask, 0.0, -mx.inf).astype(dtype)
        return mx.broadcast_to(mask, (b, self.n_kv, g, mask.shape[-1])) + 0


def layer_form(model) -> str:
    """The layer form of ``model`` the lean step computes ("llama", "gemma3" or
    "gemma2"); raises ``_Unsupported`` (why) for anything else."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers:
        raise _Unsupported("no model.model.layers")
    if all(type(layer) is llama.TransformerBlock for layer in layers):
        if any(getattr(layer, "use_sliding", False) for layer in layers):
            raise _Unsupported("sliding-window llama layers")
        return "llama"
    if type(model) is gemma3_text.Model and all(
        type(layer) is gemma3_text.TransformerBlock for layer in layers
    ):
        return "gemma3"
    if type(model) is gemma2.Model and all(
        type(layer) is gemma2.TransformerBlock for layer in layers
    ):
        return "gemma2"
    kinds = sorted({f"{type(layer).__module__}.{type(layer).__name__}" for layer in layers})
    raise _Unsupported(f"layer type {', '.join(kinds)} is not llama's, gemma3_text's or gemma2's")


def _residual(x, y):
    """``x + y`` as gemma3_text's ``clip_residual`` computes it (float16 sums in
    float32, clipped to float16's range; other dtypes as they are)."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


def _rope_settings(rope) -> tuple:
    """What makes two rope modules compute the same rotation (their class and numbers;
    the tables are checked against every layer's module anyway)."""
    attrs = ("dims", "traditional", "base", "scale", "_freqs", "mscale")
    values = []
    for a in attrs:
        v = getattr(rope, a, None)
        if isinstance(v, mx.array):
            v = tuple(v.tolist())
        values.append(v)
    return (type(rope), *values)


class _Unsupported(Exception):
    pass
