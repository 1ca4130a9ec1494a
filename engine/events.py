"""How token events cross from a worker thread into an asyncio event loop.

The worker calls a request's ``emit`` with each ``TokenEvent``; for requests that came
through ``EngineClient`` that is a ``LoopEmit``, and the worker batches a step's events
per event loop through ``deliver_all`` (one wake-up a step, not one a row)."""

from __future__ import annotations

import asyncio

from engine.types import TokenEvent


class LoopEmit:
    """Hands a request's events to its asyncio queue from the worker thread.

    Called with one event it schedules that event (``call_soon_threadsafe``). The
    worker batches instead: ``deliver_all`` hands a whole step's events for one event
    loop over in one call, so a step of B rows wakes the loop once, not B times (each
    wake-up is a write to the loop's self-pipe, and the loop thread then competes with
    the worker for the GIL)."""

    __slots__ = ("loop", "put")

    def __init__(self, loop: asyncio.AbstractEventLoop, put) -> None:
        self.loop, self.put = loop, put

    def __call__(self, event: TokenEvent) -> None:
        self.loop.call_soon_threadsafe(self.put, event)


def _put_all(items: list) -> None:
    for put, event in items:
        put(event)


def deliver_all(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """``items``: [(put, event)] for queues of ``loop``, in order; one wake-up."""
    loop.call_soon_threadsafe(_put_all, items)
