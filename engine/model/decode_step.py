"""A faster decode step for llama-family models: fused projections, on CPU and GPU.

``FusedDecodeStep(model)`` is a drop-in for ``model(tokens, cache=cache)[:, -1, :]``
in a decode step (one token per row): Q, K and V come from one matmul and gate and
up from another (the weights concatenated once at construction; the modules'
weights become views of the fused arrays, so no memory is added), and the
attention is ``engine.model.attention``'s routing: MLX's fused SDPA kernel on a GPU when
the batch needs no array mask, the grouped-query matmuls otherwise (always on the
CPU). ``make_decode_step`` picks the configuration per backend:

- CPU: every piece before and after the KV update under ``mx.compile`` (fuses the
  RMSNorm/RoPE/SwiGLU fallbacks into a few JIT kernels), float ``nn.Linear``
  weights fused, quantized ones left as they are: the step measured in
  ``engine/backends/cpu/tuning.py`` (1.1-1.3x over the plain module call).
- GPU: fused projections, float and quantized (``QuantizedLinear`` parts are fused
  when they share bits, group size and mode), every product written the way
  ``engine/backends/cuda/linear.py``'s plan says for its row count, the hidden state carried as
  [B, D] (so that every product is one [B, K] x [K, N] product; with [B, 1, D] MLX's
  CUDA quantized matmul runs B one-row products), without ``mx.compile``: what
  bench/gpu/NOTES.md measured on the H200 for 1b bf16 ("fused", +11% at B=1 alone,
  +57% together with a pipelined loop that the engine does not have yet). A
  per-layer compiled step was not measured there; ``compile=True`` asks for it.
  With engine/backends/cuda/attention/decode.py's kernel and a cache that has ``reserve`` (``BatchKV``),
  RoPE and the KV write happen inside the attention kernel, from the q/k/v product as
  it comes out (``rope``: the RoPE table; None keeps them separate ops).

Prefill keeps using the model's own modules (which read the same weights).
"""

from __future__ import annotations

import logging
import os
import threading

from engine.backends.cuda.linear import GpuLinear, GpuQuantizedLinear

log = logging.getLogger("markbase.decode_step")


def supported(model) -> str | None:
    """None when ``FusedDecodeStep`` can run ``model``, else why not."""
    try:
        from mlx_lm.models import llama
    except ImportError:
        return "mlx-lm is not installed"
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not layers:
        return "no model.model.layers"
    for layer in layers:
        if type(layer) is not llama.TransformerBlock:
            return f"layer type {type(layer).__name__} is not llama's TransformerBlock"
        if getattr(layer, "use_sliding", False):
            return "sliding-window layers"
    return None


class FusedDecodeStep:
    """``step(tokens [B, 1] int32, cache) -> logits [B, V]`` (lazy), for decode.

    Drop-in for ``model(tokens, cache=cache)[:, -1, :]`` on a llama-family mlx-lm
    model, with any cache that follows the mlx-lm protocol (``update_and_fetch``,
    ``offset`` int or per-row array, ``make_mask``), e.g. markbase's ``BatchKV``.
    Only for L == 1 decode steps; prefill keeps using the model.

    ``fuse``: concatenate Q/K/V and gate/up weights; ``fuse_quantized``: also for
    ``QuantizedLinear`` modules; ``compile``: ``mx.compile`` the per-layer pieces
    around the KV update and the head; ``flat``: carry the hidden state as [B, D]
    through norms, projections and MLP (reshaped to [B, H, 1, hd] only for RoPE,
    the KV update and attention), default on with ``gpu_plans``: with [B, 1, D]
    MLX's CUDA ``quantized_matmul`` runs B one-row products that each read the
    whole weight (8b 4-bit, B=32: 104 ms a step, bench/gpu/NOTES.md). Compiled pieces retrace once per batch size
    (a few ms each in Python; the JIT kernels they need are compiled once per
    machine and cached by MLX), so keep batch sizes to a few buckets (1, 2, 4, 8,
    16) if batches change size often.
    """

    def __init__(
        self,
        model,
        *,
        fuse: bool = True,
        fuse_quantized: bool = False,
        compile: bool = True,
        gpu_plans: bool = False,
        flat: bool | None = None,
    ) -> None:
        import mlx.core as mx
        import mlx.nn as nn

        from engine.backends.cuda import linear as gpu_linear
        from engine.backends.cuda import prefetch as gpu_prefetch
        from engine.backends.cuda.products import qblock as gpu_qblock
        from engine.backends.cuda.products import qlayer as gpu_qlayer

        why = supported(model)
        if why:
            raise ValueError(f"FusedDecodeStep does not support this model: {why}")
        self.model = model
        self.inner = model.model
        self.compiled = compile
        self.gpu_plans = gpu_plans
        # the 2-D step's q and k through one RoPE call (MARKBASE_GPU_JOINT_ROPE=0: two)
        self.joint_rope = os.environ.get("MARKBASE_GPU_JOINT_ROPE", "1") != "0"
        # the residual adds and the SwiGLU inside the products (engine/backends/cuda/products/mma.py) where
        # the plan sends a step's rows there (MARKBASE_GPU_FOLD=0: separate ops, for A/B)
        self.fold = os.environ.get("MARKBASE_GPU_FOLD", "1") != "0"
        # with fold, the RMSNorms before qkv, gate_up and the lm_head are handed to the
        # products, whose routes take them inside the 1-row kernel where
        # engine/gpu_qstream.takes_norm says so (MARKBASE_GPU_QSTREAM_NORM=0 turns it
        # off; on since session 24, NOTES.md) and else apply them first;
        # fold_norm: inside engine/backends/cuda/products/mma.py's 2+-row ones too (_norm forms), off unless
        # MARKBASE_GPU_NORM_FOLD=1: the step's GPU time went up 45-60% (session 8)
        self.fold_norm = os.environ.get("MARKBASE_GPU_NORM_FOLD", "0") == "1"
        # the hidden state as [B, D] between attentions (default: with gpu_plans,
        # i.e. on a GPU; the CPU's compiled step keeps [B, 1, D] as it was measured)
        self.flat = gpu_plans if flat is None else flat
        wrap = mx.compile if compile else (lambda f: f)
        self._pre, self._post, self._qkv = [], [], []
        self._products: list = []  # (linear, residual, glu): what warm_up compiles for
        # engine/backends/cuda/products/qlayer.py's one-kernel layer tail at one row (MARKBASE_GPU_QSTREAM_LAYER=1;
        # off: measured slower, sessions 14 and 25); per layer, whether the kernel takes it
        self.qlayer = gpu_qlayer.wanted()
        # ... and the next layer's RMSNorm + q/k/v product as its fourth phase
        # (MARKBASE_GPU_QSTREAM_LAYER=2): the step is then two kernels a layer
        self.qlayer_next = gpu_qlayer.wanted_next()
        self._qlayer_ok: list[bool] = []
        # engine/backends/cuda/prefetch.py: at one row, o_proj's weights and the first gate/up
        # rows asked into L2 beside the attention (MARKBASE_GPU_L2_PREFETCH=0: off)
        self.l2_prefetch = gpu_plans and gpu_prefetch.enabled()
        self._prefetch_calls: dict = {}  # (layer, dtype, shape) -> its launch, or None
        # the rows' offsets and starts, at 1-2 rows, copied into device memory once a
        # step before the kernels read them (MARKBASE_GPU_DEVICE_SCALARS=1; off: measured
        # slower, session 24): see ``_device_scalars``
        self.device_scalars = (
            gpu_plans and os.environ.get("MARKBASE_GPU_DEVICE_SCALARS", "0") == "1"
        )
        self._tails: list = []  # (o_proj, gate_up, down_proj) a layer
        self._wqkv: list = []  # the fused q/k/v product a layer (or None)
        self.fused_groups = 0  # how many of the 2 per layer got one matmul
        for layer in self.inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            wqkv = wgu = None
            if fuse:
                qkv = [attn.q_proj, attn.k_proj, attn.v_proj]
                wqkv = fuse_linears(qkv, fuse_quantized, gpu_plans)
                wgu = fuse_linears([mlp.gate_proj, mlp.up_proj], fuse_quantized, gpu_plans)
            self.fused_groups += (wqkv is not None) + (wgu is not None)
            # gpu_plans: every product follows engine/backends/cuda/linear.py's plan by rows
            o_proj = (gpu_plans and gpu_linear.for_module(attn.o_proj)) or attn.o_proj
            down_proj = (gpu_plans and gpu_linear.for_module(mlp.down_proj)) or mlp.down_proj
            nq = attn.n_heads * attn.head_dim
            nk = attn.n_kv_heads * attn.head_dim
            hq, hkv = attn.n_heads, attn.n_kv_heads

            def qkv_of(x, layer=layer, wqkv=wqkv):
                # the fused q/k/v product of the [B, D] step, its RMSNorm inside where
                # the kernel takes it (``_folds_norm``)
                norm = layer.input_layernorm
                if self._folds_norm(wqkv, norm):
                    return wqkv.fused(x, norm=norm, mma_norm=self.fold_norm)
                return wqkv(norm(x))

            def pre(
                x,
                offset,
                layer=layer,
                attn=attn,
                wqkv=wqkv,
                nq=nq,
                nk=nk,
                hq=hq,
                hkv=hkv,
                qkv_of=qkv_of,
            ):
                # x: [B, L, D], or [B, D] for the 2-D step (one position per row)
                b = x.shape[0]
                length = x.shape[1] if x.ndim == 3 else 1
                norm = layer.input_layernorm
                if x.ndim == 2 and wqkv is not None and self.joint_rope:
                    # q and k heads side by side through one RoPE call (the rotation is
                    # per head, the offsets per row): one reshape copy and one rope
                    # kernel a layer instead of two each; q and k come back as views
                    qkv = qkv_of(x)
                    # (views; one split call costs less Python than two slices)
                    qk, v = mx.split(qkv, [nq + nk], axis=1)
                    qk = attn.rope(qk.reshape(b, hq + hkv, 1, -1), offset=offset)
                    q, k = mx.split(qk, [hq], axis=1)
                    return q, k, v.reshape(b, hkv, 1, -1)
                h = norm(x)
                if wqkv is not None:
                    q, k, v = mx.split(wqkv(h), [nq, nq + nk], axis=-1)
                else:
                    q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
                if x.ndim == 2:  # [B, H*hd] -> [B, H, 1, hd]: the same order, no transpose
                    q = q.reshape(b, attn.n_heads, 1, -1)
                    k = k.reshape(b, attn.n_kv_heads, 1, -1)
                    v = v.reshape(b, attn.n_kv_heads, 1, -1)
                else:
                    q = q.reshape(b, length, attn.n_heads, -1).transpose(0, 2, 1, 3)
                    k = k.reshape(b, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
                    v = v.reshape(b, length, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
                return attn.rope(q, offset=offset), attn.rope(k, offset=offset), v

            # one row: o_proj + residual, the RMSNorm, gate_up + SwiGLU and down_proj +
            # residual as one kernel (engine/backends/cuda/products/qlayer.py) where it takes the layer
            one_kernel = (
                gpu_plans
                and type(layer.post_attention_layernorm) is nn.RMSNorm
                and gpu_qlayer.supported(
                    self.inner.norm.weight.dtype,
                    1,
                    o_proj.weight.shape[0] if hasattr(o_proj, "weight") else 0,
                    down_proj.weight.shape[1] * 8 if hasattr(down_proj, "weight") else 0,
                    o_proj,
                    wgu,
                    down_proj,
                )
            )
            self._qlayer_ok.append(bool(one_kernel))
            self._tails.append((o_proj, wgu, down_proj))
            self._wqkv.append(wqkv)

            def post(
                x,
                o,
                layer=layer,
                mlp=mlp,
                wgu=wgu,
                o_proj=o_proj,
                down_proj=down_proj,
                slot=len(self._post),
            ):
                b, _, length, _ = o.shape
                if self.qlayer and self._qlayer_ok[slot] and x.ndim == 2 and b == 1:
                    norm = layer.post_attention_layernorm
                    return gpu_qlayer.post(
                        o.reshape(1, -1), x, o_proj, wgu, down_proj, norm.weight, norm.eps, slot
                    )
                if (
                    self.fold
                    and x.ndim == 2
                    and all(hasattr(f, "fused") for f in (wgu, o_proj, down_proj))
                ):
                    # the residual adds inside the o_proj and down_proj products and
                    # silu(gate) * up inside gate_up's (engine/backends/cuda/products/mma.py): 7 graph
                    # nodes a layer fewer when the plan sends these rows there
                    h = o_proj.fused(o.reshape(b, -1), residual=x)
                    norm = layer.post_attention_layernorm
                    if self._folds_norm(wgu, norm):
                        z = wgu.fused(h, glu=True, norm=norm, mma_norm=self.fold_norm)
                    else:
                        z = wgu.fused(norm(h), glu=True)
                    return down_proj.fused(z, residual=h)
                if x.ndim == 2:  # o [B, H, 1, hd] -> [B, H*hd]
                    h = x + o_proj(o.reshape(b, -1))
                else:
                    h = x + o_proj(o.transpose(0, 2, 1, 3).reshape(b, length, -1))
                z = layer.post_attention_layernorm(h)
                if wgu is not None:
                    g, u = mx.split(wgu(z), 2, axis=-1)
                else:
                    g, u = mlp.gate_proj(z), mlp.up_proj(z)
                return h + down_proj(nn.silu(g) * u)

            # (product, residual, glu, an RMSNorm before it)
            self._products += [(wqkv, False, False, True), (wgu, False, True, True)]
            self._products += [(o_proj, True, False, False), (down_proj, True, False, False)]
            self._pre.append(wrap(pre))
            self._qkv.append(wrap(qkv_of) if wqkv is not None else None)
            self._post.append(wrap(post))

        tied = getattr(getattr(model, "args", None), "tie_word_embeddings", True)
        lm_head = None
        if not tied and hasattr(model, "lm_head"):
            lm_head = (gpu_plans and gpu_linear.for_module(model.lm_head)) or model.lm_head

        def head(x):
            norm = self.inner.norm
            if (
                x.ndim == 2
                and isinstance(lm_head, GpuQuantizedLinear)
                and self._folds_norm(lm_head, norm)
            ):  # the final RMSNorm inside the 1-row product (qkv's)
                return lm_head.fused(x, norm=norm, mma_norm=self.fold_norm)
            x = norm(x[:, -1, :] if x.ndim == 3 else x)
            if lm_head is None:
                return self.inner.embed_tokens.as_linear(x)
            return lm_head(x)

        self._head = wrap(head)
        self._lm_head = lm_head
        # GPU: decode attention as engine/backends/cuda/attention/decode.py's kernel (no mask, one
        # kernel a layer instead of MLX's masked fallback's seven)
        self.attention_kernel = bool(gpu_plans) and attention_kernel_wanted(model)
        # ... and with RoPE and the KV write inside it, from the fused q/k/v product
        # (3 nodes a layer fewer; MARKBASE_GPU_ROPE_APPEND=0: RoPE and the cache's
        # slice updates as separate ops, for A/B runs)
        self.rope = None
        if self.attention_kernel and all(f is not None for f in self._qkv) and self.flat:
            if os.environ.get("MARKBASE_GPU_ROPE_APPEND", "1") != "0":
                self.rope = rope_for_kernel(self.inner.layers)
        # the whole append-form step under one mx.compile (on unless
        # MARKBASE_GPU_STEP_COMPILE=0): the decode step at one row is host-bound, about
        # half of it Python building ~233 kernel calls a step (bench/gpu/NOTES.md,
        # sessions 11-13); a compiled step replays them from MLX's tape instead
        # (measured on an H100, session 15: 1b bf16 B=1 398 -> 659 tok/s, B=8 3379 ->
        # 5226; 8b 4-bit B=8 1725 -> 2037). Its inputs keep their shapes from step to
        # step (the attention kernel takes the whole cache buffers and T from each
        # row's position), so it retraces only when the batch size, the buffers'
        # capacity (every 256 steps) or the attention's split count changes; the
        # warm-up traces the batch sizes it runs, and a retrace later cost no step over
        # ~80 ms in the session-15 table (max step at B=32/128, as without it)
        self.step_compile = (
            self.rope is not None and os.environ.get("MARKBASE_GPU_STEP_COMPILE", "1") != "0"
        )
        self._whole = mx.compile(self._whole_step) if self.step_compile else None
        # whether layer i's kernel can also make layer i + 1's q/k/v product
        self._next_ok = [
            ok
            and i + 1 < len(self._qlayer_ok)
            and self._wqkv[i + 1] is not None
            and type(self.inner.layers[i + 1].input_layernorm) is nn.RMSNorm
            and gpu_qlayer.next_supported(
                self._wqkv[i + 1].weight.shape[1] * 8,
                self._tails[i][0].group_size,
                self._wqkv[i + 1],
            )
            for i, ok in enumerate(self._qlayer_ok)
        ]
        # whether layer i is one kernel, its attention included (engine/backends/cuda/products/qblock.py,
        # MARKBASE_GPU_QSTREAM_LAYER=3)
        self.qblock = gpu_qblock.wanted()
        self._block_ok = [
            ok
            and gpu_qblock.attention_supported(
                layer.self_attn.n_heads,
                layer.self_attn.n_kv_heads,
                layer.self_attn.head_dim,
                self.inner.norm.weight.shape[0],
                self.rope,
            )
            for ok, layer in zip(self._qlayer_ok, self.inner.layers)
        ]
        if any(self._qlayer_ok):  # made now: a compiled step must find them made
            gpu_qlayer.ensure_barriers(len(self._qlayer_ok))
        # (thread, batch size) whose split counters are made; threads whose stream-K
        # buffers are (both are per thread)
        self._counted: set = set()
        self._sk_threads: set = set()

    def _folds_norm(self, linear, norm) -> bool:
        """Whether ``norm`` is handed to ``linear``'s ``fused`` (``fold``, an
        ``nn.RMSNorm``, a plan-following product); the product's route then takes it
        into the kernel where that kernel has the form (the 1-row one always,
        engine/backends/cuda/products/mma.py's with ``fold_norm``), else applies it first."""
        import mlx.nn as nn

        return (
            self.fold
            and type(norm) is nn.RMSNorm
            and isinstance(linear, (GpuLinear, GpuQuantizedLinear))
        )

    def warm_up(self) -> None:
        """Compile the custom kernels' variants now (engine/worker.py's warm-up): which
        one a step runs depends on its rows and length, and NVRTC takes ~1 s each."""
        import mlx.core as mx
        import mlx.nn as nn

        from engine.backends.cuda import linear as gpu_linear
        from engine.backends.cuda.attention import decode as gpu_attention
        from engine.backends.cuda.products import gemv as gpu_gemv
        from engine.backends.cuda.products import mma as gpu_mma

        dtype = self.inner.norm.weight.dtype
        if self.attention_kernel:
            attn = self.inner.layers[0].self_attn
            gpu_attention.warm(
                attn.n_heads,
                attn.n_kv_heads,
                attn.head_dim,
                dtype,
                attn.scale,
                self.rope,
                whole_buffers=self.step_compile,
            )
        if not (self.gpu_plans and mx.cuda.is_available() and dtype in (mx.bfloat16, mx.float16)):
            return
        groups = tuple(
            sorted(
                {
                    m.group_size
                    for m in self.model.modules()
                    if isinstance(m, nn.QuantizedLinear) and m.bits == 4 and m.group_size % 32 == 0
                }
            )
        )
        quantized, float_ = gpu_linear.uses("qgemv") and bool(groups), gpu_linear.uses("gemv")
        if quantized or float_:
            gpu_gemv.warm(dtype, groups, quantized=quantized, float_=float_)
        if gpu_linear.uses("mma") or gpu_linear.uses("qmma") or gpu_linear.uses("qstream"):
            gpu_mma.warm(dtype, self._mma_products())
        if gpu_linear.uses("qstream"):
            from engine.backends.cuda.products import qstream as gpu_qstream

            gpu_qstream.warm(dtype, self._qstream_products())
        if gpu_linear.uses("qgemm"):
            from engine.backends.cuda.products import qgemm as gpu_qgemm

            gpu_qgemm.warm(dtype, self._qgemm_products())
            from engine.backends.cuda.products import wgmma as gpu_wgmma

            if gpu_wgmma.enabled():
                gpu_wgmma.warm(dtype, self._qgemm_products(gpu_wgmma.supported))
        if self.qlayer and any(self._qlayer_ok):
            from engine.backends.cuda.products import qlayer as gpu_qlayer

            mlp = self.inner.layers[0].mlp
            nxt = self.qlayer_next and any(self._next_ok)
            gpu_qlayer.warm(
                dtype,
                mlp.down_proj.weight.shape[0],
                mlp.down_proj.weight.shape[1] * 8,
                mlp.down_proj.group_size,
                next_rows=self._wqkv[1].weight.shape[0] if nxt else 0,
            )
        if self.qblock and any(self._block_ok) and self.rope is not None:
            self._warm_blocks(dtype)
        if self.qlayer and any(self._qlayer_ok):
            from engine.backends.cuda.products import qlayer as gpu_qlayer

            if gpu_qlayer.timed_out():  # a GPU that cannot hold the grid: wrong numbers
                log.error("gpu_qlayer: a grid barrier timed out in warm-up; kernel off")
                self.qlayer = self.qblock = False

    def _warm_blocks(self, dtype) -> None:
        """Compile engine/backends/cuda/products/qblock.py's kinds (with and without the next layer's
        q/k/v product: a middle layer and the last) on the step's own weights, zero
        inputs and a throwaway one-slot cache, one launch at a time."""
        import mlx.core as mx

        attn = self.inner.layers[0].self_attn
        d = self.inner.norm.weight.shape[0]
        zero = mx.zeros((1,), dtype=mx.int32)
        for i in sorted({0, len(self._block_ok) - 1}):
            if not self._block_ok[i]:
                continue
            kv = [mx.zeros((1, attn.n_kv_heads, 1, attn.head_dim), dtype=dtype) for _ in range(2)]
            qkv = mx.zeros((1, self._wqkv[i].weight.shape[0]), dtype=dtype)
            x = mx.zeros((1, d), dtype=dtype)
            mx.eval(self._layer(i, x, qkv, kv[0], kv[1], zero, zero)[0])

    def _mma_products(self) -> set:
        """(group size or 0, K, N, residual, glu, norm) of every product the step can
        send to engine/backends/cuda/products/mma.py (gpu_mma.warm compiles their variants)."""
        from engine.backends.cuda import linear as gpu_linear
        from engine.backends.cuda.products import mma as gpu_mma

        dtype = self.inner.norm.weight.dtype
        quant = gpu_linear.uses("qmma") or gpu_linear.uses("qstream")
        float_ = gpu_linear.uses("mma")
        out = set()
        for linear, residual, glu, normed in self._products:
            norm = normed and self.fold and self.fold_norm
            if quant and isinstance(linear, GpuQuantizedLinear):
                n, k = linear.weight.shape[0], linear.scales.shape[-1] * linear.group_size
                if gpu_mma.quant_supported(
                    dtype, n, k, linear.bits, linear.group_size, linear.mode, linear.biases
                ):
                    out.add((linear.group_size, k, n, residual, glu, norm))
            elif float_ and isinstance(linear, GpuLinear):
                n, k = linear.weight.shape
                if gpu_mma.float_supported(dtype, linear.weight.dtype, n, k):
                    out.add((0, k, n, residual, glu, norm))
        return out

    def _products_and_head(self) -> list:
        """``_products`` and the output layer (no residual, no SwiGLU, its RMSNorm
        before it), for the warm-ups of the kernels that may run it."""
        return self._products + [(self._lm_head, False, False, True)]

    def _qgemm_products(self, supported=None) -> set:
        """(group size, K, N, residual, glu) of every product the step can send to
        engine/backends/cuda/products/qgemm.py (gpu_qgemm.warm compiles their variants), or to the kernel
        whose ``supported`` is given (engine/backends/cuda/products/wgmma.py's)."""
        from engine.backends.cuda.products import qgemm as gpu_qgemm

        dtype = self.inner.norm.weight.dtype
        out = set()
        # the output layer too (gpu_qgemm.takes may give it to the kernel)
        for linear, residual, glu, _ in self._products_and_head():
            if not isinstance(linear, GpuQuantizedLinear):
                continue
            n, k = linear.weight.shape[0], linear.scales.shape[-1] * linear.group_size
            if (supported or gpu_qgemm.supported)(
                dtype, n, k, linear.bits, linear.group_size, linear.mode, linear.biases
            ):
                out.add((linear.group_size, k, n, residual, glu))
        return out

    def _qstream_products(self) -> set:
        """(group size, K, residual, glu, norm) of every 1-row product the step can send
        to engine/backends/cuda/products/qstream.py (the lm_head too: it has the qkv's K, so shares its
        kernel on llama shapes, but a model need not)."""
        from engine.backends.cuda.products import qstream as gpu_qstream

        dtype = self.inner.norm.weight.dtype
        out = set()
        for linear, residual, glu, normed in self._products_and_head():
            if not isinstance(linear, GpuQuantizedLinear):
                continue
            n, k = linear.weight.shape[0], linear.scales.shape[-1] * linear.group_size
            if gpu_qstream.supported(
                dtype, 1, n, k, linear.bits, linear.group_size, linear.mode, linear.biases
            ):
                norm = normed and self.fold and gpu_qstream.takes_norm(n, glu)
                out.add((linear.group_size, k, residual, glu, norm))
        return out

    def _compiled_call(self, tokens, cache):
        """The step through ``_whole`` (``step_compile``), or None where it does not
        apply (a cache without ``reserve``/``start``, more than one token a row)."""
        import mlx.core as mx

        from engine.backends.cuda import linear as gpu_linear
        from engine.backends.cuda.attention import decode as gpu_attention
        from engine.backends.cuda.products import qgemm as gpu_qgemm

        first = cache[0]
        start = getattr(first, "start", None)
        if tokens.shape[1] != 1 or start is None or not hasattr(first, "reserve"):
            return None
        offset = first.offset  # the new token's positions: read before reserve
        if not isinstance(offset, mx.array) or offset.ndim != 1:
            return None
        buffers = []
        for c in cache:
            buffers.extend(c.reserve(1, views=False))
        b = tokens.shape[0]
        hkv = self.inner.layers[0].self_attn.n_kv_heads
        nsplit = gpu_attention.append_splits(b, hkv, first.length)
        if b == 1 and self.qblock and all(self._block_ok):
            nsplit = 0  # every layer's attention in its kernel: T does not shape the trace
        me = threading.get_ident()
        if nsplit > 1 and (me, b) not in self._counted:
            gpu_attention.ensure_counters(b * hkv, len(cache))
            self._counted.add((me, b))
        if me not in self._sk_threads:  # once a thread: not a plan lookup every step
            if gpu_linear.uses("qgemm"):
                gpu_qgemm.ensure_stream_k()  # its buffers are made outside the trace
            self._sk_threads.add(me)
        if self.device_scalars:
            offset, start = _device_scalars(offset), _device_scalars(start)
        return self._whole(tokens, offset, start, buffers, nsplit)

    def _whole_step(self, tokens, offset, start, buffers, nsplit: int):
        """The append-form step as one function of arrays whose shapes do not change
        with T (``buffers``: each layer's whole key and value buffers, in order), for
        ``mx.compile``; ``nsplit``, a constant of the trace, is the attention's split
        count for this T."""

        x = self.inner.embed_tokens(tokens)
        x = x.reshape(x.shape[0], -1)
        qkv = None  # this layer's q/k/v product when the last layer's kernel made it
        for i in range(len(self.inner.layers)):
            qkv_i = self._qkv[i](x) if qkv is None else qkv
            x, qkv = self._layer(
                i, x, qkv_i, buffers[2 * i], buffers[2 * i + 1], start, offset, nsplit
            )
        return self._head(x)

    def _layer(self, i: int, x, qkv, keys, values, start, offset, nsplit=None):
        """Layer ``i`` of the append-form step from its q/k/v product on: (its output,
        the next layer's q/k/v product when a kernel of this layer made it, else None).
        One kernel (engine/backends/cuda/products/qblock.py, ``qblock``), or the attention kernel and the
        tail (``_tail``)."""
        from engine.backends.cuda.attention import decode as gpu_attention

        layer = self.inner.layers[i]
        attn = layer.self_attn
        attention_args = (qkv, keys, values, start, offset, self.rope, attn.scale, attn.n_heads)
        if self.qblock and self._block_ok[i] and x.ndim == 2 and x.shape[0] == 1:
            from engine.backends.cuda.products import qblock as gpu_qblock

            norm = layer.post_attention_layernorm
            nxt = None
            if self.qlayer_next and self._next_ok[i]:
                norm1 = self.inner.layers[i + 1].input_layernorm
                nxt = (self._wqkv[i + 1], norm1.weight, norm1.eps)
            o_proj, gate_up, down_proj = self._tails[i]
            out = gpu_qblock.block(
                *attention_args,
                x,
                o_proj,
                gate_up,
                down_proj,
                norm.weight,
                norm.eps,
                i,
                next_qkv=nxt,
            )
            return out if nxt is not None else (out, None)
        if self.l2_prefetch:
            x = self._prefetched(i, x, qkv)
        o = gpu_attention.decode_attention_append(*attention_args, slot=i, nsplit=nsplit)
        return self._tail(i, x, o)

    def _prefetched(self, i: int, x, qkv):
        """``x``, copied by engine/backends/cuda/prefetch.py's kernel, which runs beside layer
        ``i``'s attention (both wait for ``qkv``) and asks L2 for the start of its
        o_proj and gate/up weights; ``x`` itself where that kernel does not apply.
        Whether it applies and its launch are worked out once per layer and shape."""
        from engine.backends.cuda import prefetch as gpu_prefetch

        key = (i, x.dtype, x.shape)
        call = self._prefetch_calls.get(key, False)
        if call is False:
            o_proj, gate_up, _ = self._tails[i]
            call = None
            if gpu_prefetch.takes(x, o_proj, gate_up):
                call = gpu_prefetch.launcher(x.dtype, x.shape, o_proj, gate_up)
            self._prefetch_calls[key] = call
        return x if call is None else call(x, qkv)

    def _tail(self, i: int, x, o):
        """Layer ``i``'s part after the attention: (its output, the next layer's q/k/v
        product when engine/backends/cuda/products/qlayer.py's kernel made it too (``qlayer_next``), else
        None)."""
        if (
            self.qlayer
            and self.qlayer_next
            and self._next_ok[i]
            and x.ndim == 2
            and x.shape[0] == 1
        ):
            from engine.backends.cuda.products import qlayer as gpu_qlayer

            norm = self.inner.layers[i].post_attention_layernorm
            norm1 = self.inner.layers[i + 1].input_layernorm
            o_proj, gate_up, down_proj = self._tails[i]
            return gpu_qlayer.post(
                o.reshape(1, -1),
                x,
                o_proj,
                gate_up,
                down_proj,
                norm.weight,
                norm.eps,
                i,
                next_qkv=(self._wqkv[i + 1], norm1.weight, norm1.eps),
            )
        return self._post[i](x, o), None

    def __call__(self, tokens, cache):
        import mlx.core as mx
        from mlx_lm.models.base import create_attention_mask

        from engine.backends.cuda.attention import decode as gpu_attention
        from engine.model.attention import scaled_dot_product_attention

        if self._whole is not None:
            logits = self._compiled_call(tokens, cache)
            if logits is not None:
                return logits
        x = self.inner.embed_tokens(tokens)
        off = cache[0].offset
        offset = off if isinstance(off, mx.array) else mx.array(off, dtype=mx.int32)
        start = getattr(cache[0], "start", None) if self.attention_kernel else None
        if start is not None and x.shape[1] == 1:
            mask = None  # the kernel reads each row's valid range [start, T) itself
        else:
            start, mask = None, create_attention_mask(x, cache[0])
        if self.flat and x.shape[1] == 1:
            # [B, 1, D] -> [B, D]: every product sees B rows of one matrix (a 3-D input
            # makes MLX's CUDA quantized matmul run B one-row products, each reading
            # the whole weight: bench/gpu/NOTES.md, session 3)
            x = x.reshape(x.shape[0], -1)
        append = self.rope is not None and start is not None and x.ndim == 2 and offset.ndim == 1
        if append and self.device_scalars:
            offset, start = _device_scalars(offset), _device_scalars(start)
        qkv = None  # the next layer's q/k/v product when a layer's kernel made it
        for i, (layer, pre, post, c) in enumerate(
            zip(self.inner.layers, self._pre, self._post, cache)
        ):
            attn = layer.self_attn
            if append and hasattr(c, "reserve"):
                # RoPE, the KV write and the attention in one kernel (gpu_attention)
                keys, values = c.reserve(1)
                qkv_i = self._qkv[i](x) if qkv is None else qkv
                x, qkv = self._layer(i, x, qkv_i, keys, values, start, offset)
                continue
            qkv = None
            q, k, v = pre(x, offset)
            keys, values = c.update_and_fetch(k, v)
            # L == 1: grouped-query matmuls on the CPU and under an array mask on a
            # GPU, MLX's fused kernel on a GPU without one (engine/model/attention.py)
            if start is not None:
                o = gpu_attention.decode_attention(q, keys, values, start, attn.scale, slot=i)
            else:
                o = scaled_dot_product_attention(q, keys, values, c, attn.scale, mask)
            x = post(x, o)
        return self._head(x)


def _device_scalars(a):
    """``a`` (int32 [B]) as a view of a 16-byte array a GPU op made, where it is 8 bytes
    or less; else ``a``. Why: MLX's CUDA allocator keeps every array of 8 bytes or less
    in one small pool of managed memory (mlx/backend/cuda/allocator.cpp,
    ``SmallSizePool``) that the host also touches each step (at B=1 it reads the
    sampled token there), so at 1-2 rows each attention block's read of its row's
    offset and start may cross to host memory, 32 kernels a step at 8b; small copy
    kernels read them once instead. Measured (H100, bench/gpu/NOTES.md session 24):
    the attention 14.4 -> 13.5 us a call, but the copies cost more (8b 4-bit B=1 step
    2.455 -> 2.542 ms), so it stays off; kept for profile_step.py's ``-ds``."""
    import mlx.core as mx

    if a.nbytes > 8:
        return a
    from engine.backends.cuda.products.mma import SCALAR_WORDS

    pad = mx.zeros((SCALAR_WORDS - a.shape[0],), dtype=a.dtype)
    return mx.concatenate([a, pad])[: a.shape[0]]


class _FusedFloat:
    """``x @ w.T`` with the concatenated weight ``w``."""

    def __init__(self, weight) -> None:
        self.weight = weight

    def __call__(self, x):
        return x @ self.weight.T


class _FusedQuantized:
    """``mx.quantized_matmul`` over concatenated weight/scales/biases rows."""

    def __init__(self, weight, scales, biases, group_size: int, bits: int, mode: str) -> None:
        self.weight, self.scales, self.biases = weight, scales, biases
        self.group_size, self.bits, self.mode = group_size, bits, mode

    def __call__(self, x):
        import mlx.core as mx

        return mx.quantized_matmul(
            x,
            self.weight,
            scales=self.scales,
            biases=self.biases,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
        )


def fuse_linears(linears, quantized: bool = False, gpu_plans: bool = False):
    """One callable ``f(x)`` = the outputs of ``linears`` concatenated, or None.

    Float ``nn.Linear`` weights are concatenated along the output dim. With
    ``quantized``, ``nn.QuantizedLinear`` modules that share bits, group size and
    mode are too (weight, scales and biases rows: quantization groups run along
    the input dim, so output rows concatenate without requantizing). The modules'
    arrays become views into the fused ones (no extra memory). None if the group
    mixes kinds or settings, or any module has a bias."""
    import mlx.core as mx
    import mlx.nn as nn

    from engine.backends.cuda import prefill as gpu_prefill

    if any("bias" in lin for lin in linears):
        return None
    if all(type(lin) is nn.Linear for lin in linears):
        names = ("weight",)
    elif quantized and all(gpu_prefill.is_plain_quantized(lin) for lin in linears):
        first = linears[0]
        settings = {(lin.bits, lin.group_size, getattr(lin, "mode", "affine")) for lin in linears}
        has_biases = {lin.get("biases") is not None for lin in linears}
        if len(settings) != 1 or len(has_biases) != 1:
            return None
        names = ("weight", "scales", "biases") if has_biases.pop() else ("weight", "scales")
    else:
        return None
    fused = {n: mx.concatenate([lin[n] for lin in linears], axis=0) for n in names}
    mx.eval(list(fused.values()))
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        for n in names:
            setattr(lin, n, fused[n][start : start + rows])
        start += rows
    mx.eval([lin[n] for lin in linears for n in names])
    if names == ("weight",):
        return GpuLinear(fused["weight"]) if gpu_plans else _FusedFloat(fused["weight"])
    return (GpuQuantizedLinear if gpu_plans else _FusedQuantized)(
        fused["weight"],
        fused["scales"],
        fused.get("biases"),
        first.group_size,
        first.bits,
        getattr(first, "mode", "affine"),
    )


def attention_kernel_wanted(model) -> bool:
    """Whether the GPU decode step runs engine/backends/cuda/attention/decode.py's kernel: on CUDA, for
    shapes it handles, unless ``MARKBASE_GPU_ATTENTION=mlx`` (MLX's own attention,
    for A/B runs)."""
    import mlx.core as mx

    from engine.backends.cuda.attention import decode as gpu_attention

    if os.environ.get("MARKBASE_GPU_ATTENTION", "kernel") == "mlx":
        return False
    if not (on_gpu() and mx.cuda.is_available()):
        return False
    attn = model.model.layers[0].self_attn
    dtype = model.model.norm.weight.dtype
    why = gpu_attention.supported(attn.n_heads, attn.n_kv_heads, attn.head_dim, dtype)
    if why:
        log.info("decode attention kernel not used: %s", why)
    return why is None


def rope_for_kernel(layers):
    """The attention kernel's RoPE table when every layer has the same RoPE module
    settings and the kernel can apply it (engine/gpu_attention.rope_table), else None."""
    from engine.backends.cuda.attention import decode as gpu_attention

    attn = layers[0].self_attn
    table = gpu_attention.rope_table(attn.rope, attn.head_dim)
    if table is None:
        log.info("RoPE stays a separate op: %s", type(attn.rope).__name__)
        return None

    def settings(rope):
        return (
            type(rope),
            *(getattr(rope, a, None) for a in ("dims", "traditional", "base", "scale")),
        )

    if any(settings(layer.self_attn.rope) != settings(attn.rope) for layer in layers):
        return None
    return table


def on_gpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.gpu


def make_decode_step(model, *, compile: bool | None = None) -> FusedDecodeStep | None:
    """The decode step for ``model`` on the default device, or None (use the model).

    CPU: ``FusedDecodeStep(model)`` (compiled, float weights fused). GPU: fused
    float and quantized weights, not compiled unless ``compile=True``. None when
    the model is not a plain llama-family model."""
    why = supported(model)
    if why:
        log.info("fused decode step not used: %s", why)
        return None
    if on_gpu():
        # MARKBASE_GPU_DECODE_2D=0: the [B, 1, D] step as it was (for A/B runs)
        flat = os.environ.get("MARKBASE_GPU_DECODE_2D", "1") != "0"
        return FusedDecodeStep(
            model, fuse_quantized=True, compile=bool(compile), gpu_plans=True, flat=flat
        )
    return FusedDecodeStep(model, compile=True if compile is None else compile)
