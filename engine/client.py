"""The engine's front door for the HTTP layer: submit a request, read its tokens.

``EngineClient.generate`` is an async generator of ``TokenEvent``s. Events cross
from the worker thread into the event loop with ``call_soon_threadsafe``; closing
the generator early (client gone, task cancelled) aborts the sequence in the
worker, which frees its batch slot at the next step.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

from engine.backends import cpu
from engine.config import EngineConfig
from engine.events import LoopEmit
from engine.loading import load_models
from engine.types import (
    ContextLengthError,
    EngineDeadError,
    EngineError,
    GenerationRequest,
    GrammarSpec,
    ModelInfo,
    OverloadedError,
    TokenEvent,
    UnknownModelError,
)
from engine.worker import ModelWorker

log = logging.getLogger("markbase.engine")

_ERROR_KINDS: dict[str, type[EngineError]] = {
    "overloaded": OverloadedError,
    "engine_dead": EngineDeadError,
    "context_length": ContextLengthError,
}


class EngineClient:
    def __init__(self, workers: dict[str, ModelWorker], infos: dict[str, ModelInfo]) -> None:
        self._workers = workers
        self._infos = infos
        self._tensor_parallel = None  # rank 0's TensorParallelGroup, when there is one

    @classmethod
    def start(cls, config: EngineConfig) -> EngineClient:
        """Load every configured model, each on a thread of its own (engine.loading's
        ``load_models``), and start one worker thread per model."""
        cpu.warn_if_slow(logger=log)  # a reference BLAS makes the CPU backend 10-40x slower
        if config.tensor_parallel > 1:
            return cls._start_tensor_parallel(config)
        loaded = load_models(config.models)
        for lm, _ in loaded:
            log.info(
                "loaded %s (%s, %s) in %.1f s",
                lm.name,
                lm.architecture,
                lm.weight_format,
                lm.load_seconds,
            )
        return cls.from_loaded(loaded, config)

    @classmethod
    def _start_tensor_parallel(cls, config: EngineConfig) -> EngineClient:
        """One model over ``config.tensor_parallel`` ranks of this host: this process is
        rank 0 (HTTP, scheduler, sampling), the others replay its every step.

        What the lockstep leaves out, for now: the prefix cache (each rank would have
        to hold the same entries; off), the pipelined decode loop (the plan carries
        token ids, read back each step; off), the warm-up (off), and the CPU's
        quantized decode products and fused decode step (the sharded layers are
        mlx-lm's own)."""
        import dataclasses

        from engine.distributed import LockstepRunner, TensorParallelGroup

        if len(config.models) != 1:
            raise ValueError("--tensor-parallel serves exactly one model")
        mc = config.models[0]
        group, lm = TensorParallelGroup.start(mc, config.tensor_parallel)
        try:
            tp_config = dataclasses.replace(
                config, prefix_cache_tokens=0, pipeline_decode=False, warmup=False
            )
            runner = LockstepRunner(lm.model, group.leader)
            worker = ModelWorker(lm, tp_config, mc.max_context, runner=runner)
            client = cls._serve([(lm, worker)])
        except BaseException:
            group.close()
            raise
        client._tensor_parallel = group
        group.watch(worker.fail)
        return client

    @classmethod
    def _serve(cls, pairs) -> EngineClient:
        """Starts each (LoadedModel, ModelWorker) and waits until all are warm."""
        workers, infos = {}, {}
        now = int(time.time())
        for lm, worker in pairs:
            if lm.name in workers:
                raise ValueError(f"Two models are named '{lm.name}': give one a distinct name.")
            worker.start()  # warms up first (EngineConfig.warmup), then serves
            workers[lm.name] = worker
            infos[lm.name] = ModelInfo(
                name=lm.name,
                architecture=lm.architecture,
                context_length=worker.context_length,
                source=str(lm.source),
                created=now,
                has_chat_template=bool(getattr(lm.tokenizer, "has_chat_template", False)),
            )
        for worker in workers.values():  # the first requests find the kernels compiled
            worker.wait_ready()
        return cls(workers, infos)

    @classmethod
    def from_loaded(cls, loaded, config: EngineConfig) -> EngineClient:
        """Serve already-loaded models: [(LoadedModel, max_context or None), ...]."""
        names = [lm.name for lm, _ in loaded]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ValueError(f"Two models are named '{dup}': give one a distinct name.")
        return cls._serve([(lm, ModelWorker(lm, config, mc)) for lm, mc in loaded])

    # -- what is served ------------------------------------------------------------
    def models(self) -> list[ModelInfo]:
        return list(self._infos.values())

    def get_model(self, name: str) -> ModelInfo:
        try:
            return self._infos[name]
        except KeyError:
            served = ", ".join(sorted(self._infos))
            raise UnknownModelError(
                f"The model '{name}' does not exist. Served models: {served}."
            ) from None

    def tokenizer(self, name: str):
        self.get_model(name)
        return self._workers[name].tokenizer

    def compile_grammar(self, name: str, spec: GrammarSpec) -> None:
        """Compile ``spec`` for model ``name`` now (kept in the model's grammar cache, so
        the worker only copies it); raises GrammarError naming what is not supported.
        Blocking (the first call per model builds llguidance's token trie, ~1 s): call
        it from a thread."""
        self.worker(name).grammars.compile(spec)

    def worker(self, name: str) -> ModelWorker:
        self.get_model(name)
        return self._workers[name]

    # -- generation ----------------------------------------------------------------
    async def generate(self, req: GenerationRequest) -> AsyncIterator[TokenEvent]:
        worker = self.worker(req.model)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[TokenEvent] = asyncio.Queue()

        worker.submit(req, LoopEmit(loop, events.put_nowait))
        finished = False
        first = True
        try:
            while True:
                event = await events.get()
                if event.finish_reason is not None:
                    finished = True
                if first and event.error and event.completion_tokens == 0:
                    raise _ERROR_KINDS.get(event.error_kind or "", EngineError)(event.error)
                first = False
                yield event
                if finished:
                    return
        finally:
            if not finished:
                worker.abort(req.request_id)

    # -- lifecycle -----------------------------------------------------------------
    def health(self) -> dict:
        dead = {n: repr(w.fatal) for n, w in self._workers.items() if not w.alive()}
        if dead:
            return {"status": "error", "detail": f"engine worker down: {dead}"}
        return {"status": "ok", "models": {n: w.stats() for n, w in self._workers.items()}}

    def stop_workers(self) -> None:
        """Ends every sequence and stops the workers; safe from any thread."""
        for w in self._workers.values():
            w.stop()

    def shutdown(self) -> None:
        """Stops the workers (and a tensor-parallel model's other ranks). The process's
        last act (``markbase serve``) should then be
        ``engine.worker.release_mlx_thread_state()`` on the main thread; not done here,
        since it destroys that thread's MLX streams for any later use."""
        self.stop_workers()
        if self._tensor_parallel is not None:
            self._tensor_parallel.close()
