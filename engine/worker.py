"""The engine worker: one thread that owns one model, its KV caches and its batch.

Every MLX call for the model happens on this thread. Other threads talk to it only
through ``submit``/``abort`` (a thread-safe inbox) and the per-request ``emit``
callback it calls with ``TokenEvent``s. One loop iteration is one step:

    inbox -> admit (scheduler) -> decode the running batch -> prefill chunks
          -> sample -> emit tokens -> drop finished rows
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import mlx.core as mx

from engine import metrics, platform
from engine.backends import cuda
from engine.cache_layout import Caches
from engine.config import (
    EngineConfig,
    pipeline_decode_enabled,
    warmup_batch_sizes,
    warmup_enabled,
    warmup_prefill_rows,
)
from engine.events import LoopEmit, deliver_all
from engine.heap import HeapTrimmer
from engine.kv import KVRows
from engine.logprobs import StepLogprobs, prompt_logprobs, step_logprobs
from engine.prefix_cache import PrefixCache
from engine.progress import bar
from engine.runner import ModelRunner
from engine.sampler import RowSampler, sample_batch
from engine.scheduler import (
    PrefillPlan,
    Scheduler,
    defer_shared_starts,
    prompt_groups,
)
from engine.sequence import SeqState, Sequence, StopMatcher
from engine.state_cache import StateRows
from engine.structured import FORWARD_FIRST, GrammarCompiler, MaskFiller, StepOrder, TokenMasks
from engine.tokenizer import StreamingDetokenizer
from engine.types import (
    ContextLengthError,
    EngineDeadError,
    FinishReason,
    GenerationRequest,
    GrammarError,
    OverloadedError,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)

log = logging.getLogger("markbase.engine")

# Prompt tokens a step prefills of a prompt whose logprobs were asked for: each
# position's logits are kept ([n, V] float32: 128 x 49k tokens = 25 MB).
PROMPT_LOGPROBS_CHUNK = 128

Emit = Callable[[TokenEvent], None]


class ModelWorker:
    def __init__(
        self,
        loaded,
        config: EngineConfig,
        max_context: int | None = None,
        runner: ModelRunner | None = None,
    ) -> None:
        self.loaded = loaded
        self.name = loaded.name
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.context_length = min(
            c for c in (loaded.context_length, max_context, config.max_kv_tokens) if c
        )
        # ``runner``: another way to run the model (a tensor-parallel rank 0's
        # LockstepRunner); by default the model runs here alone.
        self.runner = runner or ModelRunner(loaded.model, loaded.cpu_shadows)
        layout = self.runner.layout
        self.scheduler = Scheduler(config, kv_tokens=layout.kv_tokens)
        self.prefix_cache = PrefixCache(config.prefix_cache_tokens, layout=layout)
        self.mlx_memory = (0, 0)  # MLX active and cached bytes, refreshed by the worker
        self.metrics = metrics.ModelMetrics(self.name)
        self.batch: Caches = self.runner.new_batch_kv()
        # Constrained decoding (engine/structured): grammars compiled for this model's
        # vocabulary, and the filler of each step's masks. On the CPU one thread fills
        # them row after row: llguidance's pool of spinning threads, beside OpenBLAS's
        # on the same cores, made a B=32 step 3x slower (bench/structured_bench.py).
        self.grammars = GrammarCompiler(self.tokenizer, model_vocab_size(loaded))
        self.masks = MaskFiller(
            self.grammars.vocab_size,
            self.tokenizer.eos_token_ids,
            parallel=not platform.on_cpu(),
        )
        # which order a pipelined step with constrained rows does its work in, by timing
        self.step_order = StepOrder()

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        # events of this iteration, handed over together at its end (_flush_outbox)
        self._outbox: list = []
        self._wake = threading.Event()
        self._waiting_count = 0  # read by submitters without the worker's lists
        self._lock = threading.Lock()
        self.waiting: deque[Sequence] = deque()
        self.prefilling: list[Sequence] = []
        self.running: list[Sequence] = []  # row i of self.batch
        self.kv_reserved = 0
        self.steps = 0
        self.heap = HeapTrimmer()  # gives freed heap pages back (engine/heap.py)
        self.pipeline = pipeline_decode_enabled(config)
        # The queued decode step (pipelined mode): its sampled tokens, on the
        # device, the rows they belong to and their logprobs (None: no row asked).
        self._inflight: tuple[mx.array, list[Sequence], StepLogprobs | None] | None = None
        self.fatal: BaseException | None = None
        self._stopping = False
        self._closed = False  # set under _lock once the worker stops taking requests
        self._ready = threading.Event()  # set once the warm-up is over (or skipped)
        self.warmup_s: float | None = None  # how long the warm-up took; None: not run
        self._thread = threading.Thread(target=self._loop, name=f"engine-{self.name}", daemon=True)

    # -- called from other threads ------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive() and self.fatal is None

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Blocks until the warm-up is done (or was skipped, or the worker died)."""
        return self._ready.wait(timeout)

    def submit(self, request: GenerationRequest, emit: Emit) -> None:
        """Queue a request; raises at once when it can never run or the queue is full."""
        if not self.alive():
            raise EngineDeadError(
                f"The engine for model '{self.name}' is not running: {self.fatal!r}"
            )
        n_prompt = len(request.prompt_tokens)
        if n_prompt == 0:
            raise ContextLengthError("The prompt is empty: send at least one token.")
        if n_prompt >= self.context_length:
            raise ContextLengthError(
                f"This model's maximum context length is {self.context_length} tokens. "
                f"However, your prompt has {n_prompt} tokens, which leaves no room for a completion."
            )
        seq = Sequence(
            request=request,
            sampler=None,  # made on the worker thread at admission: no MLX call here
            detokenizer=StreamingDetokenizer(
                self.tokenizer,
                context=request.prompt_tokens[-4:],
                skip_special_tokens=request.skip_special_tokens,
            ),
            stop=StopMatcher(request.params.stop),
            eos_ids=frozenset() if request.params.ignore_eos else self.tokenizer.eos_token_ids,
            max_len=self.context_length,
            emit=emit,
        )
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"The engine for model '{self.name}' is not running.")
            if self._waiting_count >= self.config.max_queued_requests:
                raise OverloadedError(
                    f"Server overloaded: {self._waiting_count} requests are already waiting "
                    f"(max_queued_requests={self.config.max_queued_requests}). Retry later."
                )
            self._waiting_count += 1
            self._inbox.put(("submit", seq))
        self._wake.set()

    def fail(self, exc: BaseException, grace_s: float = 2.0) -> None:
        """From any thread: the model cannot run any more. The worker loop ends with
        ``exc`` at its next iteration, failing every request (``engine_dead``). If the
        worker thread is stuck inside MLX for good (a collective whose peer died
        never returns), this thread fails the requests instead after ``grace_s``, so
        no client waits forever; the stuck thread touches none of them again."""
        self.fatal = exc
        self._inbox.put(("fatal", exc))
        self._wake.set()
        self._thread.join(grace_s)
        if self._thread.is_alive():
            log.error("engine worker for %s is stuck; failing its requests", self.name)
            self._finish_all(FinishReason.ERROR, f"The engine failed: {exc}", "engine_dead")

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Waits for the loop to leave MLX: a thread still inside MLX when the
        interpreter exits aborts the process (``terminate called ...``)."""
        self._stopping = True
        self._wake.set()
        if self.fatal is not None:  # a worker stuck in MLX never ends: do not wait long
            timeout = min(timeout, 2.0)
        if self._thread.is_alive():
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("engine worker for %s did not stop within %.0f s", self.name, timeout)
        self.masks.close()

    # -- the loop (worker thread only) ------------------------------------------------
    def _loop(self) -> None:
        try:
            if warmup_enabled(self.config):
                try:
                    log.info(
                        "warming up %s: a prefill chunk and decode steps at batch sizes %s ...",
                        self.name,
                        ", ".join(map(str, warmup_batch_sizes(self.config.max_num_seqs))),
                    )
                    self.warmup_s = self.warm_up()
                    log.info("warm-up of %s took %.2f s", self.name, self.warmup_s)
                except Exception:  # only an optimisation: serve without it
                    log.exception("warm-up of %s failed; serving without it", self.name)
            self._ready.set()
            while not self._stopping:
                if not (self.waiting or self.prefilling or self.running):
                    self._wake.wait(timeout=0.5)
                self._wake.clear()
                self._drain_inbox()
                if self.waiting or self.prefilling or self.running:
                    self.step()
                    self.heap.worked()
                    self.heap.maybe_trim(self.prefix_cache.freed_bytes, idle=False)
                else:
                    self._update_gauges()  # an abort may have emptied the batch
                    self.heap.maybe_trim(self.prefix_cache.freed_bytes, idle=True)
                self._flush_outbox()
            self._finish_all(FinishReason.ABORT, "The server is shutting down.", "engine_dead")
        except BaseException as exc:  # the worker is gone: fail everyone, loudly
            log.exception("engine worker for %s died", self.name)
            self.fatal = exc
            self._finish_all(FinishReason.ERROR, f"The engine failed: {exc!r}", "engine_dead")
        finally:
            self._ready.set()
            release_mlx_thread_state()

    def warm_up(self) -> float:
        """Run what serving runs, once, before the first request: one prefill chunk
        (a chunk without logits and a last one with them), prompts of 12-192 tokens
        (``warmup_prefill_rows``: the short-chunk product's forms compile per row band,
        gpu_mma's on CUDA, MLX's ``quantized_matmul`` per tile size where it runs them),
        then two decode steps at
        each of ``warmup_batch_sizes(max_num_seqs)`` (rows of different lengths, as
        in the running batch; one step with equal rows too) with greedy and
        top-p sampling. It compiles MLX's JIT kernels (CUDA: NVRTC, kept in the PTX
        cache) and traces the compiled decode step per batch size. Throwaway KV
        only: the batch, the prefix cache, the KV budget and the metrics are not
        touched. Returns the seconds it took."""
        t0 = time.monotonic()
        runner = self.runner
        step_warm_up = getattr(runner.decode_step, "warm_up", None)
        if step_warm_up is not None:  # kernels a step picks by length (GPU attention)
            step_warm_up()
        cfg = self.loaded.config or {}
        vocab = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size") or 2
        sizes = warmup_batch_sizes(self.config.max_num_seqs)
        steps = 2
        tail = 8  # the last chunk of a prompt: the one whose logits are sampled
        total = max(2, min(self.scheduler.chunk_tokens + tail, self.context_length - steps - 1))
        n = max(1, total - tail)
        prompt = [(i * 7919 + 13) % vocab for i in range(total)]
        greedy = RowSampler.from_params(SamplingParams(temperature=0.0))
        kv = runner.new_sequence_kv()
        runner.prefill(kv, prompt[:n], want_logits=False)
        logits = runner.prefill(kv, prompt[n:], want_logits=True)
        first = sample_batch(logits[None], [greedy])
        prompt_rows = kv.rows()
        mx.eval(first, kv.arrays())
        # temperature-only rows (a GPU's sampling kernel, engine/backends/cuda/sampler.py, from
        # MIN_ROWS rows): alone (the logits' dtype) and beside a top-p row (float32)
        n = cuda.SAMPLER_MIN_ROWS + 1
        plain = RowSampler.from_params(SamplingParams(temperature=1.0, seed=0))
        top_p = RowSampler.from_params(SamplingParams(temperature=1.0, top_p=0.9, seed=0))
        rows_of = mx.broadcast_to(logits[None], (n, logits.shape[-1]))
        mx.eval(
            sample_batch(rows_of, [plain] * n),
            sample_batch(rows_of, [plain] * (n - 1) + [top_p]),
        )
        # chunks of fewer rows: their products' kernels compile per band of rows
        for rows in warmup_prefill_rows(self.scheduler.chunk_tokens, self.context_length):
            mx.eval(runner.prefill(runner.new_sequence_kv(), prompt[:rows], want_logits=True))
        token = int(first.item())
        length = total
        for b in bar(sizes, desc=f"warm-up {self.name}", unit="batch size"):
            ragged = [length - r % min(length, 8) for r in range(b)]
            for lengths in [ragged] + ([[length] * b] if b == 2 else []):
                batch = runner.new_batch_kv()
                for held in lengths:
                    batch.add([_first_positions(r, held) for r in prompt_rows])
                # a seeded top-p row besides the greedy ones (the global RNG is not used)
                samplers = [greedy] * (b - 1) + [
                    RowSampler.from_params(SamplingParams(temperature=1.0, top_p=0.9, seed=0))
                ]
                tokens = [token] * b
                for _ in range(steps if lengths is ragged else 1):
                    sampled = sample_batch(runner.decode(batch, tokens), samplers)
                    mx.eval(sampled)
                    tokens = sampled.tolist()
                del batch
        del kv, prompt_rows, logits
        mx.clear_cache()  # the throwaway KV's buffers go back to the system
        return time.monotonic() - t0

    def _drain_inbox(self) -> None:
        aborted = set()
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "submit":
                self.waiting.append(item)
            elif kind == "abort":
                aborted.add(item)
            elif kind == "fatal":  # the model can no longer run (a lost rank): end the loop
                raise item
        if aborted:
            self._abort(aborted)
        self._expire_waiting()

    def _abort(self, ids: set[str]) -> None:
        for seq in [s for s in self.waiting if s.request_id in ids]:
            self.waiting.remove(seq)
            self._dequeued()
            seq.state = SeqState.FINISHED
            self._record_finish(seq, FinishReason.ABORT)
        for seq in [s for s in self.prefilling if s.request_id in ids]:
            self.prefilling.remove(seq)
            seq.kv = None
            self._finish(seq, FinishReason.ABORT, emit=False)
        gone = [s for s in self.running if s.request_id in ids]
        for seq in gone:
            self._finish(seq, FinishReason.ABORT, emit=False)
        if gone:
            self._drop_finished_rows()

    def _expire_waiting(self) -> None:
        limit = self.config.queue_timeout_s
        now = time.monotonic()
        while self.waiting and now - self.waiting[0].arrived > limit:
            seq = self.waiting.popleft()
            self._dequeued()
            seq.state = SeqState.FINISHED
            self._send(
                seq,
                "",
                FinishReason.ERROR,
                error=f"Server overloaded: no slot became free within {limit:.0f} s. Retry later.",
                error_kind="overloaded",
            )
            self._record_finish(seq, FinishReason.ERROR)

    def _dequeued(self) -> None:
        with self._lock:
            self._waiting_count -= 1

    # -- one step -------------------------------------------------------------------
    def step(self) -> None:
        self.steps += 1
        self._admit()
        decoding = bool(self.running)
        if decoding:
            self._decode_step()
            self._flush_outbox()  # before the prefill chunks: they must not delay these tokens
        plan = self.scheduler.plan_prefill(self.prefilling, decoding=decoding)
        chunks = self._prefill_whole_prompts(plan)
        for seq, n in chunks:
            self._prefill_chunk(seq, n)
        self._update_gauges()
        self._flush_outbox()

    def _admit(self) -> None:
        active = len(self.running) + len(self.prefilling)
        for seq in self.scheduler.admit(self.waiting, active, self.kv_reserved):
            self.waiting.popleft()
            self._dequeued()
            seq.reserved_tokens = self.scheduler.kv_need(seq)
            self.kv_reserved += seq.reserved_tokens
            seq.state = SeqState.PREFILLING
            try:
                seq.sampler = RowSampler.from_params(seq.params, seq.prompt, seq.end_ids)
            except Exception as exc:  # e.g. a seed MLX cannot take: only this request fails
                self._finish(
                    seq,
                    FinishReason.ERROR,
                    error=f"Bad sampling parameters: {exc}",
                    error_kind="internal",
                )
                continue
            if seq.request.grammar is not None and not self._start_grammar(seq):
                continue
            self.metrics.prompt_tokens.inc(len(seq.prompt))
            self.prefilling.append(seq)

    def _start_grammar(self, seq: Sequence) -> bool:
        """Give a constrained sequence its own matcher (a copy of the compiled grammar,
        compiled here only if the HTTP layer did not); False if it failed and ended."""
        try:
            seq.grammar = self.grammars.matcher(seq.request.grammar)
        except GrammarError as exc:
            self._finish(seq, FinishReason.ERROR, error=str(exc), error_kind="internal")
            return False
        except Exception as exc:
            log.exception("grammar compilation failed for %s", seq.request_id)
            self._finish(
                seq, FinishReason.ERROR, error=f"Grammar failed: {exc!r}", error_kind="internal"
            )
            return False
        return True

    def _start_prefill(self, seq: Sequence, found=None) -> None:
        """Take the longest cached prefix (``found``: a lookup already made). Done at
        the first chunk, not at admission, so requests that arrive together still
        reuse the one prefilled before them."""
        if seq.wants_prompt_logprobs:  # every position's logits: nothing from the cache
            found = (0, None)
        matched, cached = found or self.prefix_cache.lookup(seq.prompt)
        self.metrics.prefix_cache_queries.inc(len(seq.prompt))
        if matched:
            seq.kv = self.runner.sequence_from(cached)
            seq.prefilled = seq.cached_tokens = matched
            self.metrics.prefix_cache_hits.inc(matched)
        else:
            seq.kv = self.runner.new_sequence_kv()
        seq.state_at = self._state_boundary(seq)

    def _state_boundary(self, seq: Sequence) -> int | None:
        """Where to keep a copy of the state layers' state, for the prefix cache: the
        last block end before the prompt's last token (what a repeat of this prompt, or
        a longer prompt starting with it, can reuse). None for models without state
        layers, or when the prompt's prefix is already cached up to there."""
        cache = self.prefix_cache
        if not (self.runner.layout.has_state and cache.enabled):
            return None
        at = (len(seq.prompt) - 1) // cache.block * cache.block
        return at if at > seq.prefilled else None

    def _keep_state(self, seq: Sequence) -> None:
        """``seq`` has been fed up to its state boundary: copy its state layers' state."""
        seq.state_at, rows = None, seq.kv.rows()
        seq.kept_state = (seq.prefilled, [r if isinstance(r, StateRows) else None for r in rows])

    def _prefill_whole_prompts(self, plan: PrefillPlan) -> list[tuple[Sequence, int]]:
        """Run the plan's prompts that end in this step and have not started yet
        together, in groups of one forward each (``ModelRunner.prefill_together``: a
        burst of short prompts otherwise pays a pass over the weights per prompt), each
        from its cached prefix if it has one; returns the chunks left to run one by
        one. A prompt that starts as an earlier uncached one does waits a step (not
        looked up, not counted), then finds that one's prefix cached."""
        if len(plan.chunks) < 2 or not self.runner.can_prefill_together():
            return plan.chunks
        rest, misses, hits = [], [], []
        for seq, n in plan.chunks:
            if n != len(seq.prompt) - seq.prefilled or seq.wants_prompt_logprobs:
                rest.append((seq, n))  # does not end its prompt this step, or runs alone
            elif seq.kv is None:
                found = self.prefix_cache.lookup(seq.prompt)
                if found[0]:
                    self._start_prefill(seq, found)
                    hits.append(seq)
                else:
                    misses.append(seq)
            else:
                rest.append((seq, n))
        if self.prefix_cache.enabled:
            misses, _deferred = defer_shared_starts(misses)
        for seq in misses:
            self._start_prefill(seq, (0, None))
        # A group's prompts all get their first token when its forward ends, so a group
        # is at most one chunk's worth of padded tokens (CPU 128, GPU 2048: what a step
        # prefills while others decode), and each group's tokens go out as it ends.
        cap = min(plan.budget, self.scheduler.chunk_tokens)
        for group in prompt_groups(misses + hits, cap):
            self.metrics.prefill_group_size.observe(len(group))
            if len(group) == 1:
                seq = group[0]
                rest.append((seq, len(seq.prompt) - seq.prefilled))
            else:
                self._prefill_group(group)
                self._flush_outbox()
        return rest

    def _prefill_group(self, group: list[Sequence]) -> None:
        try:
            heads = [s for s in group if s.state_at is not None]
            if heads:  # first up to each one's state boundary, together, then the rest
                self.runner.prefill_together(
                    [s.kv for s in heads],
                    [s.prompt[s.prefilled : s.state_at] for s in heads],
                    want_logits=False,
                )
                mx.eval([a for s in heads for a in s.kv.arrays()])
                for seq in heads:
                    seq.prefilled = seq.state_at
                    self._keep_state(seq)
            logits = self.runner.prefill_together(
                [s.kv for s in group], [s.prompt[s.prefilled :] for s in group]
            )
            tokens, lps = self._draw(logits, group, self._masks_now(group))
            mx.eval(tokens, [a for s in group for a in s.kv.arrays()])
            firsts = tokens.tolist()
            first_lps = lps.for_rows(len(group)) if lps is not None else [None] * len(group)
        except Exception:  # run them one by one instead: a failure there is theirs alone
            log.exception("prefilling %d prompts together failed; one by one", len(group))
            for seq in group:
                seq.kv, seq.prefilled, seq.cached_tokens = self.runner.new_sequence_kv(), 0, 0
                seq.state_at, seq.kept_state = self._state_boundary(seq), None
                self._prefill_chunk(seq, len(seq.prompt))
            return
        for seq, token, lp in zip(group, firsts, first_lps):
            seq.prefilled = len(seq.prompt)
            self._prefilled(seq, token, lp)

    def _prefill_chunk(self, seq: Sequence, n: int) -> None:
        try:
            if seq.kv is None:
                self._start_prefill(seq)
            start = seq.prefilled
            if seq.wants_prompt_logprobs:
                n = min(n, PROMPT_LOGPROBS_CHUNK)
            if seq.state_at is not None:  # the chunk ends at the state boundary at most
                n = min(n, seq.state_at - start)
            chunk = seq.prompt[start : start + n]
            last = start + len(chunk) >= len(seq.prompt)
            if seq.wants_prompt_logprobs:
                logits = self._prefill_scoring(seq, start, chunk)
            else:
                logits = self.runner.prefill(seq.kv, chunk, want_logits=last)
            seq.prefilled += len(chunk)
            if seq.prefilled == seq.state_at:
                self._keep_state(seq)
            if not last:
                return
            token, lps = self._draw(logits[None], [seq], self._masks_now([seq]))
            mx.eval(token, seq.kv.arrays())
            lp = lps.for_rows(1)[0] if lps is not None else None
        except Exception as exc:  # this sequence fails; the batch goes on
            log.exception("prefill failed for %s", seq.request_id)
            self.prefilling.remove(seq)
            seq.kv = None
            self._finish(
                seq, FinishReason.ERROR, error=f"Prefill failed: {exc!r}", error_kind="internal"
            )
            return
        self._prefilled(seq, int(token.item()), lp)

    def _prefill_scoring(self, seq: Sequence, start: int, chunk: list[int]) -> mx.array:
        """A chunk of a prompt whose tokens' logprobs were asked for (completions'
        ``echo`` with ``logprobs``): every position's logits, the logprobs of the
        prompt tokens they predict kept on ``seq``; returns the last position's."""
        logits = self.runner.prefill_all_logits(seq.kv, chunk)
        k = seq.params.prompt_logprobs
        seq.prompt_logprobs.extend(prompt_logprobs(logits, seq.prompt, start, k))
        return logits[-1]

    def _draw(self, logits: mx.array, seqs: list[Sequence], masks: TokenMasks | None = None):
        """The batch's next tokens (``sample_batch``, lazily, the constrained rows under
        their grammar ``masks``) and the logprobs of the rows that asked for them
        (engine/logprobs.py: the raw logits' log-softmax), or None when none asked."""
        tokens = sample_batch(logits, [s.sampler for s in seqs], masks)
        wants = [s.params.logprobs for s in seqs]
        if wants.count(None) == len(wants):
            return tokens, None
        return tokens, step_logprobs(logits, wants, tokens)

    def _prefilled(self, seq: Sequence, token: int, lp: TokenLogprob | None = None) -> None:
        """A prompt is in the cache and its first token sampled: keep its prefix for
        reuse, emit the token, and move the sequence into the running batch."""
        self.prefilling.remove(seq)
        kv, seq.kv = seq.kv, None
        rows = kv.rows()
        kept, seq.kept_state = seq.kept_state, None
        self.prefix_cache.insert(seq.prompt, _kv_only(rows), state=kept)
        if self._accept_token(seq, token, lp):
            return
        self.runner.join_batch(self.batch, kv, rows)
        seq.state = SeqState.RUNNING
        self.running.append(seq)

    def _decode_step(self) -> None:
        """One token for every running row. Pipelined (GPU): queue this step on the
        device, then deliver the previous step's tokens while it runs. Otherwise:
        compute, read back and deliver this step's tokens."""
        seqs = list(self.running)
        prev, self._inflight = self._inflight, None
        try:
            logits = self.runner.decode(self.batch, self._decode_inputs(seqs, prev))
        except Exception as exc:
            # The batched forward itself failed: nothing in this batch can go on.
            log.exception("decode step failed")
            if prev is not None:
                self._deliver(*prev)
            self._fail_batch(f"Decode failed: {exc!r}")
            return
        self.metrics.step_batch_size.observe(len(seqs))
        if self.pipeline and any(s.grammar is not None for s in seqs):
            self._decode_constrained_pipelined(logits, seqs, prev)
            return
        if self.pipeline:
            try:
                sampled, lps = self._draw(logits, seqs)
                mx.async_eval(sampled, *(lps.arrays() if lps is not None else ()))
            except Exception:
                log.exception("batched sampling failed; retrying row by row")
            else:
                self._inflight = (sampled, seqs, lps)
                if prev is not None:
                    self._deliver(*prev)
                return
        if prev is not None:
            self._deliver(*prev)
        # the constrained rows' masks are filled on the host while the forward runs
        pending = self.masks.start(self._grammar_rows(seqs))
        try:
            mx.eval(logits)
        except Exception as exc:
            log.exception("decode step failed")
            if pending is not None:
                pending.exception()  # the filler is done with the matchers before they go
            self._fail_batch(f"Decode failed: {exc!r}")
            return
        masks = self._step_masks(seqs, pending)
        self._accept_rows(seqs, *self._sample_rows(logits, seqs, masks))

    def _decode_constrained_pipelined(
        self, logits: mx.array, seqs: list[Sequence], prev: tuple | None
    ) -> None:
        """A pipelined step with constrained rows: their masks need the previous step's
        tokens on the host. Those are read back and fed to the grammars
        (``feed_ahead``), the masks are filled in the filler's thread while the tokens
        are handed on, and the masked draw is queued behind the forward. The forward is
        queued either first (the device runs it while the host fills) or right after
        the fill starts (the fill runs beside MLX's launch, which releases the GIL):
        ``self.step_order`` times both and keeps the faster
        (engine/structured/step_order.py). Every MLX call stays on this thread, and no
        matcher is touched here while the fill runs."""
        forward_first = self.step_order.next(len(seqs), time.perf_counter()) == FORWARD_FIRST
        if forward_first:
            mx.async_eval(logits)
        got = None
        if prev is not None:
            got = self._read_back(*prev)
            if got is None:
                return
            for seq, tok in zip(prev[1], got[0]):
                if seq.grammar is not None and seq.state is SeqState.RUNNING:
                    if tok not in seq.end_ids:
                        seq.grammar.feed_ahead(tok)
        pending = self.masks.start(self._grammar_rows(seqs))
        if not forward_first:
            mx.async_eval(logits)
        if got is not None:  # beside the fill: the hand-on reads what feed_ahead kept
            self._accept_rows(prev[1], *got)
        masks = self._step_masks(seqs, pending)
        if not any(s.state is SeqState.RUNNING for s in seqs):
            return
        try:
            sampled, lps = self._draw(logits, seqs, masks)
            mx.async_eval(sampled, *(lps.arrays() if lps is not None else ()))
        except Exception:
            log.exception("batched sampling failed; retrying row by row")
            try:
                mx.eval(logits)
            except Exception as exc:
                log.exception("decode step failed")
                self._fail_batch(f"Decode failed: {exc!r}")
                return
            self._accept_rows(seqs, *self._sample_rows(logits, seqs, masks))
            return
        self._inflight = (sampled, seqs, lps)

    @staticmethod
    def _grammar_rows(seqs: list[Sequence]) -> list:
        """(batch row, grammar) of the constrained rows still running."""
        return [
            (i, s.grammar)
            for i, s in enumerate(seqs)
            if s.grammar is not None and s.state is not SeqState.FINISHED
        ]

    def _masks_now(self, seqs: list[Sequence]) -> TokenMasks | None:
        """The masks of ``seqs``' constrained rows, filled now (a prefill's first token)."""
        rows = self._grammar_rows(seqs)
        return self.masks.fill(rows) if rows else None

    def _step_masks(self, seqs: list[Sequence], pending=None) -> TokenMasks | None:
        """This step's masks: a started fill's (``pending``), or filled now. If filling
        failed, the constrained rows end with an error (an unmasked token could break
        their format) and the rest go on."""
        try:
            return pending.result() if pending is not None else self._masks_now(seqs)
        except Exception as exc:
            log.exception("grammar masks failed")
            for seq in seqs:
                if seq.grammar is None or seq.state is SeqState.FINISHED:
                    continue
                self._finish(
                    seq,
                    FinishReason.ERROR,
                    error=f"Grammar mask failed: {exc!r}",
                    error_kind="internal",
                )
            return None

    def _decode_inputs(self, seqs: list[Sequence], prev: tuple | None) -> list[int] | mx.array:
        """This step's input token per row. Rows of the step still in flight take
        its sampled array (never read back); rows that joined since (they follow
        them, in order) take the token their prefill sampled."""
        if prev is None:
            return [s.next_token for s in seqs]
        sampled, snap = prev[0], prev[1]
        if len(snap) == len(seqs) and all(a is b for a, b in zip(snap, seqs)):
            return sampled
        pos = {id(s): j for j, s in enumerate(snap)}
        kept = [pos[id(s)] for s in seqs if id(s) in pos]
        joined = [s.next_token for s in seqs[len(kept) :]]
        assert all(id(s) not in pos for s in seqs[len(kept) :]), "rows out of order"
        parts = []
        if kept:
            same = kept == list(range(len(snap)))
            parts.append(sampled if same else sampled[mx.array(kept, dtype=mx.int32)])
        if joined:
            parts.append(mx.array(joined, dtype=mx.int32))
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def _deliver(
        self, sampled: mx.array, seqs: list[Sequence], lps: StepLogprobs | None = None
    ) -> None:
        """Read back a queued step's tokens (and logprobs) and hand them to their rows."""
        got = self._read_back(sampled, seqs, lps)
        if got is not None:
            self._accept_rows(seqs, *got)

    def _read_back(
        self, sampled: mx.array, seqs: list[Sequence], lps: StepLogprobs | None = None
    ) -> tuple[list[int], list[TokenLogprob | None] | None] | None:
        """A queued step's tokens and its rows' logprobs (None where none asked), or
        None if reading them failed: that is the device's, the rows' KV depends on it,
        so the batch ends."""
        try:
            tokens = sampled.tolist()
            row_lps = lps.for_rows(len(seqs)) if lps is not None else None
        except Exception as exc:
            log.exception("decode step failed")
            self._inflight = None
            self._fail_batch(f"Decode failed: {exc!r}")
            return None
        return tokens, row_lps

    def _accept_rows(
        self,
        seqs: list[Sequence],
        tokens: list[int | None],
        row_lps: list[TokenLogprob | None] | None = None,
    ) -> None:
        """One decode step's tokens, one per row (None: that row's sampling failed),
        and their logprobs where rows asked (``row_lps``, None when none did).
        All rows get their token at the same moment: one timestamp for the step, and
        the token counter and inter-token histogram are updated once per step."""
        now = time.monotonic()
        gaps: list[float] = []  # inter-token latency of each row with an earlier token
        accepted = 0
        any_done = False
        for i, (seq, tok) in enumerate(zip(seqs, tokens)):
            if seq.state is not SeqState.RUNNING:  # ended since the step was queued
                any_done = True
                continue
            if tok is None:
                any_done = True
                continue
            accepted += 1
            if seq.first_token_at is None:  # not in practice: the prefill gives the first
                self._first_token(seq, now)
            else:
                gaps.append(now - seq.last_token_at)
            seq.last_token_at = now
            try:
                if self._take_token(seq, tok, row_lps[i] if row_lps is not None else None):
                    any_done = True
            except Exception as exc:  # one sequence's bookkeeping failed: only it ends
                log.exception("token handling failed for %s", seq.request_id)
                self._finish(
                    seq,
                    FinishReason.ERROR,
                    error=f"Generation failed: {exc!r}",
                    error_kind="internal",
                )
                any_done = True
        if accepted:
            self.metrics.generation_tokens.inc(accepted)
            metrics.observe_many(self.metrics.inter_token_latency, gaps)
        if any_done:
            self._drop_finished_rows()

    def _fail_batch(self, message: str) -> None:
        for seq in self.running:
            self._finish(seq, FinishReason.ERROR, error=message, error_kind="internal")
        self._drop_finished_rows()

    def _sample_rows(
        self, logits: mx.array, seqs: list[Sequence], masks: TokenMasks | None = None
    ) -> tuple[list[int | None], list[TokenLogprob | None] | None]:
        """Sample the whole batch at once; if that fails, row by row, so only the
        rows that fail end (with an error) and the rest of the batch goes on.
        Returns the tokens and the rows' logprobs (None when no row asked)."""
        try:
            sampled, lps = self._draw(logits, seqs, masks)
            mx.eval(sampled)
            return sampled.tolist(), (lps.for_rows(len(seqs)) if lps is not None else None)
        except Exception:
            log.exception("batched sampling failed; retrying row by row")
        out: list[int | None] = []
        row_lps: list[TokenLogprob | None] = []
        for i, seq in enumerate(seqs):
            try:
                row_mask = masks.row(i) if masks is not None else None
                tok, lps = self._draw(logits[i : i + 1], [seq], row_mask)
                out.append(int(tok.item()))
                row_lps.append(lps.for_rows(1)[0] if lps is not None else None)
            except Exception as exc:
                self._finish(
                    seq,
                    FinishReason.ERROR,
                    error=f"Sampling failed: {exc!r}",
                    error_kind="internal",
                )
                out.append(None)
                row_lps.append(None)
        return out, row_lps

    # -- tokens out ------------------------------------------------------------------
    def _accept_token(self, seq: Sequence, token: int, lp: TokenLogprob | None = None) -> bool:
        """Record one sampled token (a prefill's first) and emit its text; returns True
        if the sequence ended."""
        now = time.monotonic()
        if seq.first_token_at is None:
            self._first_token(seq, now)
        else:
            self.metrics.inter_token_latency.observe(now - seq.last_token_at)
        seq.last_token_at = now
        self.metrics.generation_tokens.inc()
        return self._take_token(seq, token, lp)

    def _first_token(self, seq: Sequence, now: float) -> None:
        seq.first_token_at = now
        self.metrics.time_to_first_token.observe(now - seq.arrived)

    def _take_token(self, seq: Sequence, token: int, lp: TokenLogprob | None = None) -> bool:
        """Append ``token`` (and its logprobs, if the sequence asked) to ``seq`` and
        queue its text (stop strings cut); returns True if the sequence ended.
        Timestamps and metrics are the caller's."""
        seq.output_ids.append(token)
        if seq.logprobs is not None:
            seq.logprobs.append(lp if lp is not None else TokenLogprob(-9999.0))
        stop = seq.stop
        grammar_done = False
        if seq.grammar is not None and token not in seq.end_ids:
            if not seq.grammar.accept(token):  # not in practice: the mask allowed it
                self._finish(
                    seq,
                    FinishReason.ERROR,
                    error=f"The output left its grammar: {seq.grammar.error}",
                    error_kind="internal",
                )
                return True
            grammar_done = seq.grammar.done
        if token in seq.end_ids:  # EOS or one of the request's stop_token_ids
            text, matched = stop.feed(seq.detokenizer.flush())
            finish = FinishReason.STOP
        else:
            text = seq.detokenizer.add_token(token)
            matched = False
            if stop.stops:
                text, matched = stop.feed(text)
            if matched:
                finish = FinishReason.STOP
            elif grammar_done or len(seq.output_ids) >= seq.output_limit:
                # the grammar is complete, or max_tokens / the context is reached
                finish = FinishReason.STOP if grammar_done else FinishReason.LENGTH
                tail, matched = stop.feed(seq.detokenizer.flush())
                text += tail
                if matched:
                    finish = FinishReason.STOP
            else:
                seq.next_token = token
                if text:
                    self._send(seq, text, None)
                return False
        if not matched:
            text += stop.flush()
        self._finish(seq, finish, text=text)
        return True

    def _send(
        self,
        seq: Sequence,
        text: str,
        finish: FinishReason | None,
        *,
        error: str | None = None,
        error_kind: str | None = None,
    ) -> None:
        out = seq.output_ids
        n = len(out)
        sent = seq.sent_tokens
        event = TokenEvent(  # positional: request_id, text, token_ids, prompt_tokens, ...
            seq.request.request_id,
            text,
            (out[sent],) if sent == n - 1 else tuple(out[sent:]),
            len(seq.request.prompt_tokens),
            n,
            seq.cached_tokens,
            finish,
            error,
            error_kind,
        )
        if seq.logprobs is not None:
            event.logprobs = tuple(seq.logprobs[sent:n])
        if seq.prompt_logprobs is not None:  # the first event carries them, once
            event.prompt_logprobs = tuple(seq.prompt_logprobs)
            seq.prompt_logprobs = None
        seq.sent_tokens = n
        self._outbox.append((seq.emit, event))

    def _flush_outbox(self) -> None:
        """Hand the queued events over: per event loop one call (engine/client.py's
        ``LoopEmit``), other emit callables one by one, in the order they were sent."""
        if not self._outbox:
            return

        items, self._outbox = self._outbox, []
        by_loop: dict = {}
        for emit, event in items:
            if type(emit) is LoopEmit:
                by_loop.setdefault(emit.loop, []).append((emit.put, event))
                continue
            try:
                emit(event)
            except Exception:  # the receiver is gone; nothing to tell
                log.debug("could not deliver event for %s", event.request_id)
        for loop, batch in by_loop.items():
            try:
                deliver_all(loop, batch)
            except Exception:  # the loop is closed: its requests are gone
                log.debug("could not deliver %d events to a closed loop", len(batch))

    def _finish(
        self,
        seq: Sequence,
        reason: FinishReason,
        *,
        text: str = "",
        emit: bool = True,
        error: str | None = None,
        error_kind: str | None = None,
    ) -> None:
        if seq.state is SeqState.FINISHED:
            return
        was_running = seq.state is SeqState.RUNNING
        seq.state = SeqState.FINISHED
        seq.finish_reason = reason
        self.kv_reserved -= seq.reserved_tokens
        seq.reserved_tokens = 0
        if was_running and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self._remember_conversation(seq)
        if emit:
            self._send(seq, text, reason, error=error, error_kind=error_kind)
        self._record_finish(seq, reason)

    def _remember_conversation(self, seq: Sequence) -> None:
        """Keep prompt + reply KV so the next turn of this chat reuses it."""
        if not self.prefix_cache.enabled:
            return
        row = self.running.index(seq)
        fed = seq.prompt + seq.output_ids[:-1]  # the last token was never fed
        # state layers: the row's state may already include a token a pipelined step
        # fed, and is not at a block end; only the KV leaves are kept
        self.prefix_cache.insert(fed, _kv_only(self.batch.row(row, len(fed))))

    def _record_finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.metrics.finished(reason.value)
        self.metrics.request_latency.observe(time.monotonic() - seq.arrived)

    def _drop_finished_rows(self) -> None:
        keep = [i for i, s in enumerate(self.running) if s.state is SeqState.RUNNING]
        if len(keep) == len(self.running):
            return
        self.runner.keep_rows(self.batch, keep)
        self.running = [self.running[i] for i in keep]
        if not self.running:
            self._inflight = None  # only ended rows were in it

    def _finish_all(self, reason: FinishReason, message: str, kind: str) -> None:
        with self._lock:  # from here on submit() refuses, so the inbox drain below is final
            self._closed = True
        for seq in [*self.waiting, *self.prefilling, *self.running]:
            if seq.state is not SeqState.FINISHED:
                seq.state = SeqState.FINISHED
                self._send(seq, "", reason, error=message, error_kind=kind)
        self.waiting.clear()
        self.prefilling.clear()
        self.running.clear()
        while True:  # requests that arrived but were never picked up
            try:
                kind_, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind_ == "submit":
                self._send(item, "", reason, error=message, error_kind=kind)
        self._flush_outbox()

    def _update_gauges(self) -> None:
        self.metrics.requests_running.set(len(self.running) + len(self.prefilling))
        self.metrics.requests_waiting.set(len(self.waiting))
        self.metrics.kv_usage.set(self.kv_reserved / max(1, self.config.max_kv_tokens))
        self.metrics.kv_bytes.set(self.batch.nbytes)
        self.metrics.prefix_cache_tokens.set(self.prefix_cache.tokens_held)
        self.metrics.prefix_cache_bytes.set(self.prefix_cache.bytes_held)
        # MLX's allocator, process-wide: arrays alive, and freed buffers kept for reuse
        # (read here, on the thread that uses MLX, for stats() and /health)
        self.mlx_memory = (mx.get_active_memory(), mx.get_cache_memory())
        metrics.mlx_memory.labels("active").set(self.mlx_memory[0])
        metrics.mlx_memory.labels("cache").set(self.mlx_memory[1])

    def stats(self) -> dict:
        return {
            "running": len(self.running),
            "prefilling": len(self.prefilling),
            "waiting": len(self.waiting),
            "kv_reserved_tokens": self.kv_reserved,
            "prefix_cache_tokens": self.prefix_cache.tokens_held,
            "prefix_cache_bytes": self.prefix_cache.bytes_held,
            "mlx_active_bytes": self.mlx_memory[0],
            "mlx_cache_bytes": self.mlx_memory[1],
            "heap_trims": self.heap.trims,
            "steps": self.steps,
        }


def _kv_only(rows: list) -> list[KVRows | None]:
    """The KV leaves of one sequence's rows (state leaves as None), for the prefix cache."""
    return [r if isinstance(r, KVRows) else None for r in rows]


def _first_positions(rows, n: int):
    """``rows`` (one leaf's KVRows or StateRows) cut to its first ``n`` positions."""
    if isinstance(rows, KVRows):
        return KVRows(rows.keys[:, :, :n], rows.values[:, :, :n], rows.base)
    return rows


def release_mlx_thread_state() -> None:
    """Finishes pending work and destroys the calling thread's MLX streams.

    MLX 0.32 asks every thread that used it (the main thread too) to call
    ``mx.clear_streams()`` before it ends; otherwise the streams are torn down
    by C++ thread-local/static destructors after Python has started to
    finalize, and the process dies with SIGABRT at exit about one time in ten.
    """
    try:
        mx.synchronize()
    except Exception:  # a dead device must not hide the real error being unwound
        log.debug("mx.synchronize failed at thread exit", exc_info=True)
    clear = getattr(mx, "clear_streams", None)
    if clear is not None:
        clear()


def model_vocab_size(loaded) -> int:
    """The width of the model's logits (its config's vocab_size), or the tokenizer's."""
    cfg = loaded.config or {}
    v = cfg.get("vocab_size") or (cfg.get("text_config") or {}).get("vocab_size")
    return int(v or loaded.tokenizer.vocab_size)
