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
  docs/performance.md measured on the H200 for 1b bf16 ("fused", +11% at B=1 alone,
  +57% together with a pipelined loop that the engine does not have yet). A
  per-layer compiled step was not measured there; ``compile=True`` asks for it.
  With engine/backends/cuda/attention/decode.py's kernel and a cache that has ``reserve`` (``BatchKV``),
  RoPE and the KV write happen inside the attention kernel, from the q/k/v product as
  it comes out (``rope``: the RoPE table; None keeps them separate ops).

Prefill keeps using the model's own modules (which read the same weights).
"""

from __future__ import annotations

import logging
import threading

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from engine import envs, platform
from engine.backends import cuda
from engine.model.attention import scaled_dot_product_attention

log = logging.getLogger("markbase.decode_step")


def supported(model) -> str | None:
    """None when ``FusedDecodeStep`` can run ``model``, else why not."""
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
    whole weight (8b 4-bit, B=32: 104 ms a step, docs/performance.md). Compiled pieces retrace once per batch size
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
        why = supported(model)
        if why:
            raise ValueError(f"FusedDecodeStep does not support this model: {why}")
        self.model = model
        self.inner = model.model
        self.compiled = compile
        self.gpu_plans = gpu_plans
        # the 2-D step's q and k through one RoPE call (MARKBASE_GPU_JOINT_ROPE=0: two)
        self.joint_rope = envs.MARKBASE_GPU_JOINT_ROPE
        # the residual adds and the SwiGLU inside the products (engine/backends/cuda/products/mma.py) where
        # the plan sends a step's rows there (MARKBASE_GPU_FOLD=0: separate ops, for A/B)
        self.fold = envs.MARKBASE_GPU_FOLD
        # with fold, the RMSNorms before qkv, gate_up and the lm_head are handed to the
        # products, whose routes take them inside the 1-row kernel where
        # gpu_qstream.takes_norm says so (MARKBASE_GPU_QSTREAM_NORM=0 turns it off) and
        # else apply them first
        # the hidden state as [B, D] between attentions (default: with gpu_plans,
        # i.e. on a GPU; the CPU's compiled step keeps [B, 1, D] as it was measured)
        self.flat = gpu_plans if flat is None else flat
        wrap = mx.compile if compile else (lambda f: f)
        self._pre, self._post, self._qkv = [], [], []
        self._products: list = []  # (linear, residual, glu): what warm_up compiles for
        # engine/backends/cuda/prefetch.py: at one row, o_proj's weights and the first gate/up
        # rows asked into L2 beside the attention (MARKBASE_GPU_L2_PREFETCH=0: off)
        self.l2_prefetch = gpu_plans and cuda.l2_prefetch_enabled()
        self._prefetch_calls: dict = {}  # (layer, dtype, shape) -> its launch, or None
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
            o_proj = (gpu_plans and cuda.linear_for_module(attn.o_proj)) or attn.o_proj
            down_proj = (gpu_plans and cuda.linear_for_module(mlp.down_proj)) or mlp.down_proj
            nq = attn.n_heads * attn.head_dim
            nk = attn.n_kv_heads * attn.head_dim
            hq, hkv = attn.n_heads, attn.n_kv_heads

            def qkv_of(x, layer=layer, wqkv=wqkv):
                # the fused q/k/v product of the [B, D] step, its RMSNorm inside where
                # the kernel takes it (``_folds_norm``)
                norm = layer.input_layernorm
                if self._folds_norm(wqkv, norm):
                    return wqkv.fused(x, norm=norm)
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
            ):
                b, _, length, _ = o.shape
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
                        z = wgu.fused(h, glu=True, norm=norm)
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
            lm_head = (gpu_plans and cuda.linear_for_module(model.lm_head)) or model.lm_head

        def head(x):
            norm = self.inner.norm
            if (
                x.ndim == 2
                and isinstance(lm_head, cuda.GpuQuantizedLinear)
                and self._folds_norm(lm_head, norm)
            ):  # the final RMSNorm inside the 1-row product (qkv's)
                return lm_head.fused(x, norm=norm)
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
            if envs.MARKBASE_GPU_ROPE_APPEND:
                self.rope = rope_for_kernel(self.inner.layers)
        # the whole append-form step under one mx.compile (on unless
        # MARKBASE_GPU_STEP_COMPILE=0): the decode step at one row is host-bound, about
        # half of it Python building ~233 kernel calls a step (docs/performance.md);
        # a compiled step replays them from MLX's tape instead
        # (measured on an H100: 1b bf16 B=1 398 -> 659 tok/s, B=8 3379 ->
        # 5226; 8b 4-bit B=8 1725 -> 2037). Its inputs keep their shapes from step to
        # step (the attention kernel takes the whole cache buffers and T from each
        # row's position), so it retraces only when the batch size, the buffers'
        # capacity (every 256 steps) or the attention's split count changes; the
        # warm-up traces the batch sizes it runs, and a retrace later cost no step over
        # ~80 ms in the H100 engine table (max step at B=32/128, as without it)
        self.step_compile = self.rope is not None and envs.MARKBASE_GPU_STEP_COMPILE
        self._whole = mx.compile(self._whole_step) if self.step_compile else None
        # (thread, batch size) whose split counters are made; threads whose stream-K
        # buffers are (both are per thread)
        self._counted: set = set()
        self._sk_threads: set = set()

    def _folds_norm(self, linear, norm) -> bool:
        """Whether ``norm`` is handed to ``linear``'s ``fused`` (``fold``, an
        ``nn.RMSNorm``, a plan-following product); the product's route then takes it
        into the kernel where that kernel has the form (the 1-row one), else applies
        it first."""
        return (
            self.fold
            and type(norm) is nn.RMSNorm
            and isinstance(linear, (cuda.GpuLinear, cuda.GpuQuantizedLinear))
        )

    def warm_up(self) -> None:
        """Compile the custom kernels' variants now (engine/worker.py's warm-up): which
        one a step runs depends on its rows and length, and NVRTC takes ~1 s each."""
        dtype = self.inner.norm.weight.dtype
        if self.attention_kernel:
            attn = self.inner.layers[0].self_attn
            cuda.warm_attention(
                attn.n_heads,
                attn.n_kv_heads,
                attn.head_dim,
                dtype,
                attn.scale,
                self.rope,
                whole_buffers=self.step_compile,
            )
        if not (self.gpu_plans and platform.cuda_available()):
            return
        if dtype not in (mx.bfloat16, mx.float16):
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
        cuda.warm_products(dtype, groups, self._products, self._lm_head, self.fold)

    def _compiled_call(self, tokens, cache):
        """The step through ``_whole`` (``step_compile``), or None where it does not
        apply (a cache without ``reserve``/``start``, more than one token a row)."""
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
        nsplit = cuda.attention_splits(b, hkv, first.length)
        me = threading.get_ident()
        if nsplit > 1 and (me, b) not in self._counted:
            cuda.ensure_attention_counters(b * hkv, len(cache))
            self._counted.add((me, b))
        if me not in self._sk_threads:  # once a thread: not a plan lookup every step
            if cuda.plan_uses("qgemm"):
                cuda.ensure_stream_k()  # its buffers are made outside the trace
            self._sk_threads.add(me)
        return self._whole(tokens, offset, start, buffers, nsplit)

    def _whole_step(self, tokens, offset, start, buffers, nsplit: int):
        """The append-form step as one function of arrays whose shapes do not change
        with T (``buffers``: each layer's whole key and value buffers, in order), for
        ``mx.compile``; ``nsplit``, a constant of the trace, is the attention's split
        count for this T."""

        x = self.inner.embed_tokens(tokens)
        x = x.reshape(x.shape[0], -1)
        for i in range(len(self.inner.layers)):
            qkv = self._qkv[i](x)
            x = self._layer(i, x, qkv, buffers[2 * i], buffers[2 * i + 1], start, offset, nsplit)
        return self._head(x)

    def _layer(self, i: int, x, qkv, keys, values, start, offset, nsplit=None):
        """Layer ``i`` of the append-form step from its q/k/v product on: its output.
        The attention kernel (RoPE and the KV write inside), then the tail."""
        attn = self.inner.layers[i].self_attn
        attention_args = (qkv, keys, values, start, offset, self.rope, attn.scale, attn.n_heads)
        if self.l2_prefetch:
            x = self._prefetched(i, x, qkv)
        o = cuda.decode_attention_append(*attention_args, slot=i, nsplit=nsplit)
        return self._post[i](x, o)

    def _prefetched(self, i: int, x, qkv):
        """``x``, copied by engine/backends/cuda/prefetch.py's kernel, which runs beside layer
        ``i``'s attention (both wait for ``qkv``) and asks L2 for the start of its
        o_proj and gate/up weights; ``x`` itself where that kernel does not apply.
        Whether it applies and its launch are worked out once per layer and shape."""
        key = (i, x.dtype, x.shape)
        call = self._prefetch_calls.get(key, False)
        if call is False:
            o_proj, gate_up, _ = self._tails[i]
            call = None
            if cuda.l2_prefetch_takes(x, o_proj, gate_up):
                call = cuda.l2_prefetch_launcher(x.dtype, x.shape, o_proj, gate_up)
            self._prefetch_calls[key] = call
        return x if call is None else call(x, qkv)

    def __call__(self, tokens, cache):
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
            # the whole weight: docs/performance.md)
            x = x.reshape(x.shape[0], -1)
        append = self.rope is not None and start is not None and x.ndim == 2 and offset.ndim == 1
        for i, (layer, pre, post, c) in enumerate(
            zip(self.inner.layers, self._pre, self._post, cache)
        ):
            attn = layer.self_attn
            if append and hasattr(c, "reserve"):
                # RoPE, the KV write and the attention in one kernel (gpu_attention)
                keys, values = c.reserve(1)
                x = self._layer(i, x, self._qkv[i](x), keys, values, start, offset)
                continue
            q, k, v = pre(x, offset)
            keys, values = c.update_and_fetch(k, v)
            # L == 1: grouped-query matmuls on the CPU and under an array mask on a
            # GPU, MLX's fused kernel on a GPU without one (engine/model/attention.py)
            if start is not None:
                o = cuda.decode_attention(q, keys, values, start, attn.scale, slot=i)
            else:
                o = scaled_dot_product_attention(q, keys, values, c, attn.scale, mask)
            x = post(x, o)
        return self._head(x)


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
    if any("bias" in lin for lin in linears):
        return None
    if all(type(lin) is nn.Linear for lin in linears):
        names = ("weight",)
    elif quantized and all(cuda.is_plain_quantized(lin) for lin in linears):
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
        return cuda.GpuLinear(fused["weight"]) if gpu_plans else _FusedFloat(fused["weight"])
    return (cuda.GpuQuantizedLinear if gpu_plans else _FusedQuantized)(
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
    if envs.MARKBASE_GPU_ATTENTION == "mlx" or not platform.on_cuda():
        return False
    attn = model.model.layers[0].self_attn
    dtype = model.model.norm.weight.dtype
    why = cuda.attention_supported(attn.n_heads, attn.n_kv_heads, attn.head_dim, dtype)
    if why:
        log.info("decode attention kernel not used: %s", why)
    return why is None


def rope_for_kernel(layers):
    """The attention kernel's RoPE table when every layer has the same RoPE module
    settings and the kernel can apply it (the CUDA backend's ``rope_table``), else None."""
    attn = layers[0].self_attn
    table = cuda.rope_table(attn.rope, attn.head_dim)
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


def make_decode_step(model, *, compile: bool | None = None) -> FusedDecodeStep | None:
    """The decode step for ``model`` on the default device, or None (use the model).

    CPU: ``FusedDecodeStep(model)`` (compiled, float weights fused). GPU: fused
    float and quantized weights, not compiled unless ``compile=True``. None when
    the model is not a plain llama-family model."""
    why = supported(model)
    if why:
        log.info("fused decode step not used: %s", why)
        return None
    if platform.on_gpu():
        # MARKBASE_GPU_DECODE_2D=0: the [B, 1, D] step as it was (for A/B runs)
        flat = envs.MARKBASE_GPU_DECODE_2D
        return FusedDecodeStep(
            model, fuse_quantized=True, compile=bool(compile), gpu_plans=True, flat=flat
        )
    return FusedDecodeStep(model, compile=True if compile is None else compile)
