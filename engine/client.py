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

from engine.config import EngineConfig
from engine.events import LoopEmit
from engine.types import (
    ContextLengthError,
    EngineDeadError,
    EngineError,
    GenerationRequest,
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

    @classmethod
    def start(cls, config: EngineConfig) -> EngineClient:
        """Load every configured model and start one worker thread per model."""
        from engine.backends.cpu.blas import warn_if_slow
        from engine.loading import load_model

        warn_if_slow(logger=log)  # a reference BLAS makes the CPU backend 10-40x slower
        loaded = []
        for mc in config.models:
            t0 = time.monotonic()
            lm = load_model(mc.source, name=mc.name, weight_format=mc.weight_format)
            log.info(
                "loaded %s (%s, %s) in %.1f s",
                lm.name,
                lm.architecture,
                lm.weight_format,
                time.monotonic() - t0,
            )
            loaded.append((lm, mc.max_context))
        return cls.from_loaded(loaded, config)

    @classmethod
    def from_loaded(cls, loaded, config: EngineConfig) -> EngineClient:
        """Serve already-loaded models: [(LoadedModel, max_context or None), ...]."""
        workers, infos = {}, {}
        now = int(time.time())
        for lm, max_context in loaded:
            if lm.name in workers:
                raise ValueError(f"Two models are named '{lm.name}': give one a distinct name.")
            # made (and load-checked: ModelLoadError for a family the engine cannot
            # serve) before any worker thread starts, so a refused model leaves none behind
            workers[lm.name] = worker = ModelWorker(lm, config, max_context)
            infos[lm.name] = ModelInfo(
                name=lm.name,
                architecture=lm.architecture,
                context_length=worker.context_length,
                source=str(lm.source),
                created=now,
                has_chat_template=bool(getattr(lm.tokenizer, "has_chat_template", False)),
            )
        for worker in workers.values():
            worker.start()  # warms up first (EngineConfig.warmup), then serves
        for worker in workers.values():  # the first requests find the kernels compiled
            worker.wait_ready()
        return cls(workers, infos)

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
        """Stops the workers. The process's last act (``markbase serve``) should then
        be ``engine.worker.release_mlx_thread_state()`` on the main thread; not done
        here, since it destroys that thread's MLX streams for any later use."""
        self.stop_workers()
