"""Prompt text to token ids, without letting a long prompt stall the server.

Two defences, in the order a request meets them:

1. Length before tokenizing. A tokenizer's token stands for at most a known number
   of input bytes (``Tokenizer.max_input_bytes_per_token``: 81 for SmolLM2), so a
   prompt of B bytes has at least ``ceil(B / that)`` tokens. When even that many
   cannot fit the model's context window, a long prompt (``large_prompt_bytes`` and
   up) is answered 400 ``context_length_exceeded`` at once: a 1 MB prompt to a
   8192-token model costs a length check, not two seconds of tokenizing.
2. Tokenizing off the event loop and without the GIL. The ``tokenizers`` library
   holds the GIL in ``encode`` (a 1 MB prompt stalled every other thread of the
   process, the event loop and the engine's worker included, for ~2 s) and releases
   it in ``encode_batch``, which ``Tokenizer.encode_unlocked`` uses, in a worker
   thread. Prompts of ``large_prompt_bytes`` and more are tokenized at most
   ``max_large_tokenizations`` at a time, in threads of a lower CPU priority (on
   Linux), so they take the cores the engine leaves idle; as many more may wait
   for a turn, and past that a request is answered 429 with ``Retry-After``.

For chat, the length check runs before the template is rendered (a jinja render
of a 1 MB message takes 10-30 ms of Python, holding the GIL) when the template
writes message contents unchanged (checked with markers), and on the rendered
text otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anyio

from engine.types import ModelInfo
from server import metrics
from server.errors import APIError

log = logging.getLogger("markbase.server")


def _bound(tokenizer: Any) -> int | None:
    fn = getattr(tokenizer, "max_input_bytes_per_token", None)
    bound = fn() if fn is not None else None
    return bound if isinstance(bound, int) and bound > 0 else None


def prepare(engine: Any) -> None:
    """Work out each served tokenizer's bound now (0.2 s for a 262k vocabulary),
    before serving, not in the first request."""
    for m in engine.models():
        bound = _bound(engine.tokenizer(m.name))
        if bound is None:
            log.info("%s: no bound on bytes per token: every prompt is tokenized", m.name)
        else:
            log.info(
                "%s: prompts over %d bytes are rejected without tokenizing "
                "(a token stands for at most %d bytes, context %d)",
                m.name,
                bound * (m.context_length - 1),
                bound,
                m.context_length,
            )


def too_long_error(
    context_length: int, nbytes: int, bound: int, min_tokens: int, completion: int, chat: bool
) -> APIError:
    what = "messages" if chat else "prompt"
    message = (
        f"This model's maximum context length is {context_length} tokens. However, your "
        f"{what} {'are' if chat else 'is'} {nbytes} bytes long, which is at least {min_tokens} "
        f"tokens (no token of this model stands for more than {bound} bytes), and "
        f"{completion} more {'are' if completion != 1 else 'is'} needed for the completion. "
        f"Please reduce the length of the {what} or completion."
    )
    return APIError(400, message, param=what, code="context_length_exceeded")


def _utf8_size(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def _template_keeps_contents(render: Any, messages: list[dict]) -> bool:
    """Whether the chat template writes every message's content unchanged: rendered
    with a short marker (whitespace around it, which a ``| trim`` would eat) in place
    of each content, is each marker in the output as it went in? A render of a few
    hundred bytes, instead of the real one."""
    markers = [f" \n<<markbase-content-{i}>>\n " for i in range(len(messages))]
    probe = [{**m, "content": k} for m, k in zip(messages, markers)]
    try:
        rendered = render(probe, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - the real render will say what is wrong
        return False
    return all(k in rendered for k in markers)


def _encode(tokenizer: Any, text: str, add_special_tokens: bool) -> list[int]:
    fn = getattr(tokenizer, "encode_unlocked", None)
    if fn is not None:
        return list(fn(text, add_special_tokens=add_special_tokens))
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))


LOW_PRIORITY_NICE = 10  # CFS weight 110 against 1024 for the engine and the event loop


def _lower_priority() -> None:
    """Run this (pool) thread at a lower CPU priority: on Linux a thread has its own
    nice value, so a long tokenization takes the cores the engine leaves idle
    instead of slowing its decode steps. Elsewhere setpriority would lower the
    whole process, so nothing is done."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOW_PRIORITY_NICE)


class PromptGuard:
    def __init__(self, large_prompt_bytes: int, max_large_tokenizations: int) -> None:
        self.large_prompt_bytes = large_prompt_bytes
        self.max_large = max_large_tokenizations
        self._slots = asyncio.Semaphore(max(1, max_large_tokenizations))
        self._admitted = 0  # large tokenizations running or waiting for a slot
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, max_large_tokenizations),
            thread_name_prefix="markbase-tokenize",
            initializer=_lower_priority,
        )

    def check_length(
        self, tokenizer: Any, model: ModelInfo, text: str, completion: int | None, chat: bool
    ) -> int:
        """The UTF-8 size of ``text``; raises 400 if that alone is over the window. Only
        for long texts: a short one costs little to tokenize, and its error then gives
        the exact token count."""
        nbytes = _utf8_size(text)
        if nbytes >= self.large_prompt_bytes:
            self.check_bytes(tokenizer, model, nbytes, completion, chat)
        return nbytes

    def check_bytes(
        self, tokenizer: Any, model: ModelInfo, nbytes: int, completion: int | None, chat: bool
    ) -> None:
        """Raises 400 if text of ``nbytes`` bytes (or more) cannot fit the window."""
        bound = _bound(tokenizer)
        if bound is None:
            return
        min_tokens = math.ceil(nbytes / bound)
        need = completion if completion is not None else 1
        if min_tokens + need > model.context_length:
            metrics.PROMPTS_REJECTED_UNTOKENIZED.inc()
            raise too_long_error(model.context_length, nbytes, bound, min_tokens, need, chat)

    async def _tokenize(self, nbytes: int, work: Any) -> Any:
        """Run ``work`` in a worker thread; a large one only when it gets a slot."""
        if nbytes < self.large_prompt_bytes:
            return await anyio.to_thread.run_sync(work)
        if self._admitted >= 2 * self.max_large:
            metrics.TOKENIZER_BUSY.inc()
            raise APIError(
                429,
                f"The server is already tokenizing {self.max_large} long prompts with "
                f"{self.max_large} more waiting; retry in a moment.",
                type="rate_limit_error",
                code="tokenizer_busy",
            )
        self._admitted += 1
        try:
            async with self._slots:
                metrics.LARGE_TOKENIZATIONS.inc()
                try:
                    # Shielded: the slot stays taken until the thread is done.
                    loop = asyncio.get_running_loop()
                    return await asyncio.shield(loop.run_in_executor(self._pool, work))
                finally:
                    metrics.LARGE_TOKENIZATIONS.dec()
        finally:
            self._admitted -= 1

    async def chat_prompt(
        self,
        tokenizer: Any,
        model: ModelInfo,
        messages: list[dict],
        completion: int | None,
        **template_kwargs: Any,
    ) -> list[int]:
        """``template_kwargs``: more for the chat template (``tools=``)."""
        render = getattr(tokenizer, "render_chat", None)
        contents = sum(_utf8_size(m["content"]) for m in messages)
        if render is not None and contents >= self.large_prompt_bytes:
            # Before rendering (tens of ms of Python for 1 MB, holding the GIL):
            # where the template writes each message's text as it is, the
            # conversation has at least the messages' bytes.
            if _template_keeps_contents(render, messages):
                self.check_bytes(tokenizer, model, contents, completion, chat=True)

        def rejected(exc: Exception) -> APIError:  # a template that refuses the conversation
            return APIError(
                400, f"The chat template rejected the messages: {exc}", param="messages"
            )

        def rendered() -> str:
            try:
                return render(messages, add_generation_prompt=True, **template_kwargs)
            except Exception as exc:  # noqa: BLE001
                raise rejected(exc) from None

        def tokens(text: str) -> list[int]:
            try:
                return _encode(tokenizer, text, False)  # templates write BOS themselves
            except Exception as exc:  # noqa: BLE001
                raise APIError(
                    400, f"The messages could not be tokenized: {exc}", param="messages"
                ) from None

        if render is None:  # a tokenizer without a separate render step
            try:
                return await anyio.to_thread.run_sync(
                    lambda: list(
                        tokenizer.apply_chat_template(
                            messages, add_generation_prompt=True, **template_kwargs
                        )
                    )
                )
            except Exception as exc:  # noqa: BLE001
                raise rejected(exc) from None
        if contents >= self.large_prompt_bytes:
            # Long messages are rendered where they are tokenized, in a slot (or
            # refused 429 before the render: tens of ms of Python holding the GIL)
            def work() -> list[int]:
                text = rendered()
                self.check_length(tokenizer, model, text, completion, chat=True)
                return tokens(text)

            return await self._tokenize(contents, work)
        text = await anyio.to_thread.run_sync(rendered)
        nbytes = self.check_length(tokenizer, model, text, completion, chat=True)
        return await self._tokenize(nbytes, lambda: tokens(text))

    async def text_prompts(
        self,
        tokenizer: Any,
        model: ModelInfo,
        prompts: list[str | list[int]],
        completion: int | None,
    ) -> list[list[int]]:
        """Each text prompt as token ids (token-id prompts as they are); every text is
        checked by length first, so one request of many long prompts is refused
        before any of them is tokenized."""
        nbytes = sum(
            self.check_length(tokenizer, model, p, completion, chat=False)
            for p in prompts
            if isinstance(p, str)
        )

        def encode_all() -> list[list[int]]:
            return [_encode(tokenizer, p, True) if isinstance(p, str) else p for p in prompts]

        try:
            return await self._tokenize(nbytes, encode_all)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise APIError(
                400, f"The prompt could not be tokenized: {exc}", param="prompt"
            ) from None
