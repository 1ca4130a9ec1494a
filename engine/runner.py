"""Batched forward passes over an mlx-lm model with our KV caches.

``prefill`` runs one sequence's prompt chunk; ``decode`` runs one token for every
row of the running batch. Both return logits lazily (nothing is evaluated here
except what must be), so the worker decides when to synchronise.
"""

from __future__ import annotations

import contextlib

import mlx.core as mx

from engine import envs, platform
from engine.backends import cpu, cuda
from engine.kv import BatchKV, PromptBatchKV, SequenceKV
from engine.model import attention, moe
from engine.model.decode_step import make_decode_step


class ModelRunner:
    def __init__(
        self, model, cpu_shadows: dict | None = None, *, fused_decode: bool = True
    ) -> None:
        self.model = model
        attention.install(model)
        moe.install(model)  # expert products grouped per expert (engine/model/moe.py)
        cpu.install_fast_math(model)  # CPU: prefill's SwiGLU without MLX's slow exp
        self.num_layers = len(model.layers)
        # The inner transformer (no lm_head): prompt positions whose logits nobody
        # needs skip the vocabulary projection, the largest matmul for small models.
        self.body = getattr(model, "model", None)
        # The output layer alone, for families whose logits are exactly head(body(x)):
        # the chunk whose last logits are wanted then runs once over all its rows. The
        # fallback feeds the last token alone, a second pass that reads every weight
        # again for one row (a 2048-token GPU prefill of the 8b model: ~12 ms of ~54 ms
        # busy in 1-row products, H100, 2026-12-05).
        self.head = output_head(model) if self.body is not None else None
        # A chunk whose logits nobody wants is queued, not waited on, so the host builds
        # the next chunk (or decode step) while the device runs it. On by default on a
        # GPU: an 8192-token prompt in 512-token chunks 1.38-1.44x faster at 1b and
        # 1.19-1.20x at 8b (H100, 2026-12-05; Metal GPUs take the
        # same default, not measured there). Off on the CPU, where the host's graph
        # building shares the cores with the compute: 256-1024-token prompts in chunks
        # of 128 took 1.00-1.03x the time queued (`bench/cpu/prefill_ab.py --ab async`).
        # MARKBASE_PREFILL_ASYNC=0/1 overrides.
        on_gpu = platform.on_gpu()
        async_prefill = envs.MARKBASE_PREFILL_ASYNC
        self.async_prefill = on_gpu if async_prefill is None else async_prefill
        # Llama-family models decode through a step of their own (CPU: the lean step,
        # engine/backends/cpu/step.py; GPU: the fused one, engine/model/decode_step.py); other
        # families, or fused_decode=False, call the model as is.
        self.decode_step = _make_decode_step(model) if fused_decode else None
        # GPU: a prompt chunk's first layers start while the host builds the rest
        # (engine/backends/cuda/prefill_stages.py; MARKBASE_GPU_PREFILL_STAGES=0 turns it off).
        self.stage_every = cuda.prefill_stage_every() if on_gpu else 0
        # GPU prefill: quantized products of 256+ rows dequantize the weight and run a
        # float matmul (engine/backends/cuda/prefill.py; MARKBASE_GPU_PREFILL_DEQ_ROWS=0 turns it
        # off); after the decode step took its own copies.
        if on_gpu:
            cuda.install_prefill(model)
            # prompt chunks' RoPE offsets in device memory, not MLX's pool of tiny
            # arrays (engine/backends/cuda/rope_offsets.py)
            cuda.install_rope_offsets(model)
        # After the step fused its weights: on the CPU, decode products read the
        # quantized copies of the float32 weights (engine/backends/cpu/qgemm.py).
        self.qgemm = cpu.register_qgemm_model(model, cpu_shadows) if cpu_shadows else None

    def new_sequence_kv(self) -> list[SequenceKV]:
        return [SequenceKV() for _ in range(self.num_layers)]

    def new_batch_kv(self) -> list[BatchKV]:
        return [BatchKV() for _ in range(self.num_layers)]

    def join_batch(self, batch: list[BatchKV], kv: list[SequenceKV], layer_kv) -> None:
        """A prefilled sequence joins the running batch as its last row (``layer_kv``:
        its per-layer keys and values, ``kv``'s ``c.kv()``)."""
        for layer, (k, v) in zip(batch, layer_kv):
            layer.add(k, v)

    def keep_rows(self, batch: list[BatchKV], rows: list[int]) -> None:
        """Keeps only ``rows`` of the running batch, in that order."""
        for layer in batch:
            layer.keep(rows)

    def prefill(
        self, kv: list[SequenceKV], tokens: list[int], want_logits: bool
    ) -> mx.array | None:
        """Feed ``tokens`` of one sequence; return the last position's logits [V] if asked."""
        with self._staged(kv, len(tokens)):
            return self._prefill(kv, tokens, want_logits)

    def _prefill(
        self, kv: list[SequenceKV], tokens: list[int], want_logits: bool
    ) -> mx.array | None:
        if not want_logits:
            self._forward_body(kv, tokens)
            evaluate = mx.async_eval if self.async_prefill else mx.eval
            evaluate([c.keys for c in kv] + [c.values for c in kv])
            return None
        if self.head is not None:
            hidden = self.body(mx.array([tokens], dtype=mx.int32), cache=kv)
            return self.head(hidden[:, -1:, :])[0, -1]
        if len(tokens) > 1:
            self._forward_body(kv, tokens[:-1])
        logits = self.model(mx.array([tokens[-1:]], dtype=mx.int32), cache=kv)
        return logits[0, -1]

    def prefill_all_logits(self, kv: list[SequenceKV], tokens: list[int]) -> mx.array:
        """Feed ``tokens`` of one sequence and return every position's logits [n, V]
        (prompt logprobs need them all): the model's own call, whatever its family."""
        return self.model(mx.array([tokens], dtype=mx.int32), cache=kv)[0]

    def can_prefill_together(self) -> bool:
        """Whether ``prefill_together`` applies: the one-pass output layer is known
        (``MARKBASE_PREFILL_TOGETHER=0`` turns it off, for A/B runs)."""
        return self.head is not None and envs.MARKBASE_PREFILL_TOGETHER

    def prefill_together(self, kvs: list[list[SequenceKV]], chunks: list[list[int]]) -> mx.array:
        """The rest of several sequences' prompts in one forward: ``chunks[i]`` follows
        what ``kvs[i]`` holds (nothing for a new prompt, a cached prefix otherwise) and
        ends its prompt; returns each one's last-position logits [B, V].

        Why: a burst of short prompts prefilled one by one pays a pass over every
        weight per prompt (and on a GPU a dequantized copy of the 4-bit weights per
        prompt from 256 rows): 48 prompts of 256 tokens at 8b 4-bit took 1.75 s to
        the last first token on an H100 (2026-12-05). The chunks
        are right-padded to the longest (``PromptBatchKV``)."""
        lengths = [len(c) for c in chunks]
        width = max(lengths)
        tokens = mx.array([c + [0] * (width - len(c)) for c in chunks], dtype=mx.int32)
        layers = [
            PromptBatchKV([kv[layer] for kv in kvs], lengths) for layer in range(self.num_layers)
        ]
        with self._staged(layers, tokens.size):
            hidden = self.body(tokens, cache=layers)
        last = hidden[mx.arange(len(chunks)), mx.array(lengths, dtype=mx.int32) - 1]
        return self.head(last)

    def _staged(self, caches, rows: int):
        """A prompt chunk's forward queued in stages on a GPU (the CUDA backend's
        ``prefill_staged``); nothing on the CPU."""
        if not self.stage_every:
            return contextlib.nullcontext()
        return cuda.prefill_staged(caches, rows, self.stage_every)

    def _forward_body(self, kv: list[SequenceKV], tokens: list[int]) -> None:
        x = mx.array([tokens], dtype=mx.int32)
        if self.body is not None:
            self.body(x, cache=kv)
        else:
            self.model(x, cache=kv)

    def decode(self, batch: list[BatchKV], tokens: list[int] | mx.array) -> mx.array:
        """One token per row; returns logits [B, V]. ``tokens`` may be the previous
        step's sampled array, still being computed: the worker's pipelined loop
        builds step i+1 on it before step i's tokens reach the host."""
        if not isinstance(tokens, mx.array):
            tokens = mx.array(tokens, dtype=mx.int32)
        x = tokens.astype(mx.int32)[:, None]
        if self.decode_step is not None:
            return self.decode_step(x, batch)
        return self.model(x, cache=batch)[:, -1, :]


def _make_decode_step(model):
    """The lean step on the CPU (engine/backends/cpu/step.py), the fused one elsewhere or when
    the lean one does not fit the model; ``MARKBASE_CPU_STEP=fused`` picks the fused
    one on the CPU too (for A/B measurements)."""
    if platform.on_cpu() and envs.MARKBASE_CPU_STEP != "fused":
        step = cpu.CpuDecodeStep.build(model)
        if step is not None:
            return step
    return make_decode_step(model)


# mlx-lm families whose ``Model.__call__`` is ``body`` then the tied embedding or the
# lm_head, nothing else (no soft-capping, no scaling): checked in their sources.
PLAIN_HEAD_FAMILIES = frozenset({"llama", "gemma3_text", "qwen2", "qwen3", "qwen3_moe", "mixtral"})


def output_head(model):
    """``hidden -> logits`` of ``model`` as its own ``__call__`` computes them, or None
    for a family not known to be plain (then prefill takes the two-pass fallback)."""
    family = type(model).__module__.rsplit(".", 1)[-1]
    if family not in PLAIN_HEAD_FAMILIES:
        return None
    if hasattr(model, "tie_word_embeddings"):  # gemma3_text keeps the flag on the model
        tied = bool(model.tie_word_embeddings)
    else:
        tied = bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))
    if tied:
        return model.model.embed_tokens.as_linear
    return getattr(model, "lm_head", None)
