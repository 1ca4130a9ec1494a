"""Saying what slow work is doing: a log line when a step starts and one with its
duration when it ends, and a progress bar on a terminal.

Long first-run steps (assembling Gemma's GGUF from its package chunks, converting
tensors, building a tokenizer from GGUF metadata, the warm-up) would otherwise sit
silent for minutes. The log lines go wherever logging goes (the server log); the
bars only to a terminal (tqdm's ``disable=None``), so logs and CI output stay clean.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm import tqdm

T = TypeVar("T")


@contextlib.contextmanager
def step(log: logging.Logger, what: str) -> Iterator[None]:
    """Logs ``what ...`` now and ``what: done in X s`` (or ``failed after``) at the end."""
    log.info("%s ...", what)
    t0 = time.monotonic()
    try:
        yield
    except BaseException:
        log.info("%s: failed after %.1f s", what, time.monotonic() - t0)
        raise
    log.info("%s: done in %.1f s", what, time.monotonic() - t0)


def bar(
    iterable: Iterable[T] | None = None,
    *,
    desc: str,
    total: float | None = None,
    unit: str = "it",
    unit_scale: bool = False,
) -> tqdm:
    """A tqdm bar on standard error, drawn only when that is a terminal, and removed
    when done (the log line of the step stays)."""
    return tqdm(
        iterable,
        desc=desc,
        total=total,
        unit=unit,
        unit_scale=unit_scale,
        disable=None,
        leave=False,
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
    )
