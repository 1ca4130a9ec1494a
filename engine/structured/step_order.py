"""The order of work in a pipelined decode step with constrained rows, chosen by timing.

A constrained row's mask for step t needs the row's token of step t-1 on the host.
The worker (``ModelWorker._decode_constrained_pipelined``) has two orders for that:

- read first: read t-1's tokens back, start the mask fill in the filler's thread,
  then queue step t's forward. MLX's launch releases the GIL, so the fill runs beside
  it; but the device idles from the end of step t-1 until the launch reaches it. This
  wins where the host is the bottleneck (a small model: its launch is most of a step).
- forward first: queue step t's forward, then read t-1's tokens back and fill the
  masks while the device runs the forward. The fill then adds to the host's time but
  not to the device's; this wins where the forward takes longer than the host's work.

Which one is faster depends on the model, the batch and the machine. Measured on an
H100 (MLX 0.32.4, 2026-12-07, 8 rows all constrained, `bench/structured_bench.py
--batches 8 --fractions 0,1 --tokens 128`, the two orders alternated in one process),
as a share of unconstrained tok/s: SmolLM2-135M's shape 0.80 read first against 0.54
forward first; Llama 3 8B's shape in bfloat16 0.86 against 0.97, and in 4 bits 0.69
against 0.74. So ``StepOrder`` times both: ``probe_steps`` steps in each order, then
the one whose median step period was lower for ``keep_steps`` steps, then both again.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

READ_FIRST = "read-first"
FORWARD_FIRST = "forward-first"


@dataclass
class StepOrder:
    """Picks the order of each constrained pipelined step (module docstring).

    ``next(batch_size, now)`` is called at the start of every such step with the
    worker's clock and returns the order for it; the time to the next call is that
    step's period. A probe counts a period only between two steps of the same batch
    size where the step before was in the same order (a switch's first step is not
    counted)."""

    probe_steps: int = 8
    keep_steps: int = 512
    fixed: str | None = None  # one order always (tests, A/B runs)
    chosen: str = READ_FIRST
    _probe: list[str] = field(default_factory=list)  # the probe's orders still to run
    _periods: dict[str, list[float]] | None = None  # the probe's periods, per order
    _kept: int = 0  # steps left in the chosen order before the next probe
    _last: tuple[float, str, int, bool] | None = None  # start, order, size, countable

    def next(self, batch_size: int, now: float) -> str:
        if self.fixed is not None:
            return self.fixed
        last = self._last
        if last is not None and self._periods is not None:
            start, order, size, countable = last
            if countable and size == batch_size:
                self._periods[order].append(now - start)
        if not self._probe and self._periods is not None:
            self._choose()
        if self._probe:
            order = self._probe.pop(0)
        elif self._kept > 0:
            self._kept -= 1
            order = self.chosen
        else:
            other = FORWARD_FIRST if self.chosen == READ_FIRST else READ_FIRST
            self._probe = [other] * (self.probe_steps + 1) + [self.chosen] * (self.probe_steps + 1)
            self._periods = {READ_FIRST: [], FORWARD_FIRST: []}
            order = self._probe.pop(0)
        self._last = (now, order, batch_size, last is not None and last[1] == order)
        return order

    def _choose(self) -> None:
        """At a probe's end: the order with the lower median period where both have
        at least three, else the last choice; kept for ``keep_steps`` steps."""
        a, b = self._periods[READ_FIRST], self._periods[FORWARD_FIRST]
        if len(a) >= 3 and len(b) >= 3:
            faster = statistics.median(b) < statistics.median(a)
            self.chosen = FORWARD_FIRST if faster else READ_FIRST
        self._periods = None
        self._kept = self.keep_steps
