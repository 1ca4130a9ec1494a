"""Batched forward passes over an mlx-lm model with the engine's caches.

``prefill`` runs one sequence's prompt chunk; ``prefill_together`` the last chunks of
several prompts in one forward; ``decode`` runs one token for every row of the running
batch. They return logits lazily (nothing is evaluated here except what must be), so
the worker decides when to synchronise. The caches are those the model asks for
(engine/cache_layout.py); a model whose caches the engine cannot serve is refused
here, at load, with a ``ModelLoadError`` naming its family.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine import envs, platform
from engine.backends import cpu, cuda
from engine.cache_layout import ATTENTION, WINDOW, CacheLayout, Caches, UnsupportedCache
from engine.load_check import load_check
from engine.loading.loaded_model import ModelLoadError
from engine.model import attention, moe
from engine.model.decode_step import make_decode_step


class ModelRunner:
    def __init__(
        self,
        model,
        cpu_shadows: dict | None = None,
        *,
        fused_decode: bool = True,
        check: bool = True,
    ) -> None:
        self.model = model
        self.family = type(model).__module__.rsplit(".", 1)[-1]
        # Arrays the model made for itself outside its parameters (a RoPE's
        # frequencies, ``_freqs``) stay lazy until something evaluates them, and MLX
        # evaluates an array only on the thread whose stream made it: evaluated here,
        # the worker thread finds them ready (else gemma4_text's first prefill failed
        # with "There is no Stream(cpu, 0) in current thread").
        materialize(model)
        try:
            self.layout = CacheLayout.of(model, self.family)
        except UnsupportedCache as exc:
            raise ModelLoadError(str(exc)) from None
        # CPU: the softmax inside the score product (engine/backends/cpu/attention.py)
        attention.install(model, (cpu.sdpa_supported, cpu.sdpa) if platform.on_cpu() else None)
        moe.install(model)  # expert products grouped per expert (engine/model/moe.py)
        cpu.install_fast_math(model)  # CPU: prefill's SwiGLU without MLX's slow exp
        self.num_layers = len(self.layout.groups)  # caches the model takes (make_cache())
        # The inner transformer (no lm_head): prompt positions whose logits nobody
        # needs skip the vocabulary projection, the largest matmul for small models.
        self.body = getattr(model, "model", None)
        # The output layer alone, for families whose logits are exactly head(body(x)):
        # the chunk whose last logits are wanted then runs once over all its rows. The
        # fallback feeds the last token alone, a second pass that reads every weight
        # again for one row (a 2048-token GPU prefill of the 8b model: ~12 ms of ~54 ms
        # busy in 1-row products, H100, 2026-12-05).
        self.head = output_head(model) if self.body is not None else None
        # Other families: the model's own call with its final norm cut to the wanted
        # positions (``LastPositions``), kept only if the load check finds it exact.
        self.cut = LastPositions.find(model) if self.head is None else None
        self.together_ok = True  # the load check may find right-padded rows inexact
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
        # Llama-family models decode through a step of their own (CPU: the C step or the
        # lean one, engine/backends/cpu/; GPU: the fused one, engine/model/decode_step.py); other
        # families, or fused_decode=False, call the model as is.
        plain = self.layout.plain
        self.windowed = any(s.kind == WINDOW for s in self.layout.leaves)
        # one leaf per layer, full or sliding-window attention: what the steps index
        # (Gemma 3's sliding layers; the steps refuse layers they do not compute)
        per_layer = all(isinstance(g, int) for g in self.layout.groups) and all(
            s.kind in (ATTENTION, WINDOW) for s in self.layout.leaves
        )
        self.decode_step = _make_decode_step(model) if fused_decode and per_layer else None
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
        if check and not (plain and self.head is not None):
            # with float inputs to the quantized products (MARKBASE_QGEMM_INT8 rounds
            # the two paths' floats apart): the check is of the caches, not the numerics
            with cpu.exact_qgemm() if self.qgemm is not None else nullcontext():
                load_check(self)
        elif not check:
            self.cut = None  # kept only where the load check found it exact

    # -- caches --------------------------------------------------------------------
    def new_sequence_kv(self) -> Caches:
        return self.layout.sequence()

    def new_batch_kv(self) -> Caches:
        return self.layout.batch()

    def sequence_from(self, rows: list) -> Caches:
        """A sequence continuing from what the prefix cache returned (one per leaf)."""
        return self.layout.sequence_from(rows)

    def join_batch(self, batch: Caches, kv: Caches, rows: list) -> None:
        """A prefilled sequence joins the running batch as its last row (``rows``:
        ``kv.rows()``, one per leaf)."""
        batch.add(rows)

    def keep_rows(self, batch: Caches, rows: list[int]) -> None:
        """Keeps only ``rows`` of the running batch, in that order."""
        batch.keep(rows)

    # -- prefill -------------------------------------------------------------------
    def prefill(self, kv: Caches, tokens: list[int], want_logits: bool) -> mx.array | None:
        """Feed ``tokens`` of one sequence; return the last position's logits [V] if asked."""
        with self._staged(kv, len(tokens)):
            return self._prefill(kv, tokens, want_logits)

    def _prefill(self, kv: Caches, tokens: list[int], want_logits: bool) -> mx.array | None:
        x = mx.array([tokens], dtype=mx.int32)
        if not want_logits:
            self._forward_without_logits(kv, x, [len(tokens) - 1])
            evaluate = mx.async_eval if self.async_prefill else mx.eval
            evaluate(kv.arrays() if isinstance(kv, Caches) else [c.keys for c in kv])
            return None
        return self._last_logits(kv, x, [len(tokens) - 1])[0]

    def _last_logits(self, caches, x: mx.array, last: list[int]) -> mx.array:
        """Logits [B, V] of row i's position ``last[i]`` after one forward over ``x``."""
        rows = mx.arange(len(last))
        cols = mx.array(last, dtype=mx.int32)
        if self.head is not None:
            hidden = self.body(x, cache=caches)
            return self.head(hidden[rows, cols])
        if self.cut is not None:
            with self.cut.positions(rows, cols):
                return self.model(x, cache=caches)[:, 0]
        return self.model(x, cache=caches)[rows, cols]

    def _forward_without_logits(self, caches, x: mx.array, last: list[int]) -> None:
        if self.head is not None:
            self.body(x, cache=caches)
        elif self.cut is not None:  # the output layer on one position a row only
            with self.cut.positions(mx.arange(len(last)), mx.array(last, dtype=mx.int32)):
                self.model(x, cache=caches)
        else:
            self.model(x, cache=caches)

    def prefill_all_logits(self, kv: Caches, tokens: list[int]) -> mx.array:
        """Feed ``tokens`` of one sequence and return every position's logits [n, V]
        (prompt logprobs need them all): the model's own call, whatever its family."""
        return self.model(mx.array([tokens], dtype=mx.int32), cache=kv)[0]

    def can_prefill_together(self) -> bool:
        """Whether ``prefill_together`` applies: the last positions' logits can be had
        from one forward (a known output layer, or the checked cut), right-padded rows
        passed the load check (``MARKBASE_PREFILL_TOGETHER=0`` turns it off, for A/B
        runs)."""
        if self.head is None and self.cut is None:
            return False
        return self.together_ok and envs.MARKBASE_PREFILL_TOGETHER

    def prefill_together(
        self, kvs: list[Caches], chunks: list[list[int]], want_logits: bool = True
    ) -> mx.array | None:
        """The rest of several sequences' prompts in one forward: ``chunks[i]`` follows
        what ``kvs[i]`` holds (nothing for a new prompt, a cached prefix otherwise) and
        ends its prompt; returns each one's last-position logits [B, V] (None without
        ``want_logits``: the chunks then only fill the caches).

        Why: a burst of short prompts prefilled one by one pays a pass over every
        weight per prompt (and on a GPU a dequantized copy of the 4-bit weights per
        prompt from 256 rows): 48 prompts of 256 tokens at 8b 4-bit took 1.75 s to
        the last first token on an H100 (2026-12-05). The chunks are right-padded to
        the longest (``PromptBatchKV``; state layers keep each row's state at its real
        end, ``PromptBatchState``)."""
        lengths = [len(c) for c in chunks]
        width = max(lengths)
        tokens = mx.array([c + [0] * (width - len(c)) for c in chunks], dtype=mx.int32)
        caches = self.layout.prompt_batch(kvs, lengths)
        last = [n - 1 for n in lengths]
        with self._staged(caches, tokens.size):
            if not want_logits:
                self._forward_without_logits(caches, tokens, last)
                return None
            return self._last_logits(caches, tokens, last)

    def _staged(self, caches, rows: int):
        """A prompt chunk's forward queued in stages on a GPU (the CUDA backend's
        ``prefill_staged``); nothing on the CPU."""
        if not self.stage_every:
            return nullcontext()
        return cuda.prefill_staged(caches, rows, self.stage_every)

    # -- decode --------------------------------------------------------------------
    def decode(self, batch: list, tokens: list[int] | mx.array) -> mx.array:
        """One token per row; returns logits [B, V]. ``tokens`` may be the previous
        step's sampled array, still being computed: the worker's pipelined loop
        builds step i+1 on it before step i's tokens reach the host."""
        if not isinstance(tokens, mx.array):
            tokens = mx.array(tokens, dtype=mx.int32)
        x = tokens.astype(mx.int32)[:, None]
        if self.windowed and isinstance(batch, Caches):
            batch.compact()  # sliding layers drop keys no row can see any more
        if self.decode_step is not None:
            return self.decode_step(x, batch)
        return self.model(x, cache=batch)[:, -1, :]


def materialize(model) -> None:
    """Evaluate every array the model holds, its private ones (``_name``) included."""
    every = model.filter_and_map(lambda _m, _k, v: isinstance(v, (dict, list, mx.array)))
    mx.eval([a for _, a in tree_flatten(every) if isinstance(a, mx.array)])


class LastPositions:
    """Runs a model's own ``__call__`` with its final norm seeing only the positions
    whose logits are wanted (one a row), so the output layer and whatever follows it
    (soft-capping, scaling) run on those rows alone, as in the model's own code.

    Most mlx-lm families end ``body -> final norm -> output layer -> extras``, but the
    extras differ (Gemma's soft-cap, Granite's logit scaling) and some compute the
    logits inside the body (Gemma 3n): cutting at the norm serves them all without a
    table of heads. The load check (``load_check``) keeps it only where it gives the
    model's own logits."""

    NAMES = ("norm", "final_layernorm", "final_norm", "norm_f", "ln_f", "final_layer_norm")

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name
        self.norm = owner[name]

    @classmethod
    def find(cls, model) -> LastPositions | None:
        """The final norm of the module that holds the model's layers, if any."""
        layers = getattr(model, "layers", None)
        if not layers:
            return None
        for _, module in model.named_modules():
            # the module that holds the layers, whatever it calls them (gpt2: ``h``)
            holds = any(isinstance(v, list) and v and v[0] is layers[0] for v in module.values())
            if holds:
                for name in cls.NAMES:
                    if isinstance(module.get(name), nn.Module):
                        return cls(module, name)
        return None

    @contextmanager
    def positions(self, rows: mx.array, cols: mx.array):
        norm = self.norm

        def cut(x, *args, **kwargs):
            return norm(x[rows, cols][:, None], *args, **kwargs)

        self.owner[self.name] = cut
        try:
            yield
        finally:
            self.owner[self.name] = norm


def _make_decode_step(model):
    """On the CPU the C step (engine/backends/cpu/native_step.py: llama and Gemma 3
    layers) or the lean one (engine/backends/cpu/step.py: Gemma 2, and where the C step
    cannot run), the fused one elsewhere or when neither fits the model;
    ``MARKBASE_CPU_STEP=lean`` / ``fused`` picks those on the CPU (for A/B measurements)."""
    if platform.on_cpu() and envs.MARKBASE_CPU_STEP != "fused":
        build = (
            cpu.NativeDecodeStep.build
            if envs.MARKBASE_CPU_STEP == "native"
            else cpu.CpuDecodeStep.build
        )
        step = build(model)
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
