"""Rank 0 runs the model through ``LockstepRunner``; every other rank replays the same
operations in the same order through ``Replayer``, so the all-reduces inside each
forward meet. Sampling happens once, on rank 0: the other ranks compute logits and
drop them; the tokens they need arrive with the next ``decode`` op.

Sequences are named by a handle (an int) that rank 0 gives each per-sequence KV it
creates; when rank 0 drops that KV (garbage collected), a release op follows so the
other ranks free theirs too.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque

import mlx.core as mx

from engine.distributed.channel import Leader
from engine.runner import ModelRunner


class LockstepRunner(ModelRunner):
    """A ``ModelRunner`` that first tells the other ranks what it is about to do."""

    def __init__(self, model, leader: Leader, **kwargs) -> None:
        # no load check: its forwards would wait in all-reduces the other ranks never join
        super().__init__(model, None, fused_decode=False, check=False, **kwargs)
        self.leader = leader
        self._ids = itertools.count(1)
        self._released: deque[int] = deque()
        self._lock = threading.Lock()

    def _send(self, op: tuple) -> None:
        released = []
        while self._released:
            released.append(self._released.popleft())
        if released:
            self.leader.send(("release", released))
        self.leader.send(op)

    def new_sequence_kv(self):
        kv = super().new_sequence_kv()  # its ``handle``: what the other ranks know it by
        kv.handle = next(self._ids)
        self._send(("new", kv.handle))
        weakref.finalize(kv, self._released.append, kv.handle)
        return kv

    def prefill(self, kv, tokens, want_logits):
        self._send(("prefill", kv.handle, list(tokens), want_logits))
        return super().prefill(kv, tokens, want_logits)

    def prefill_all_logits(self, kv, tokens):
        self._send(("all_logits", kv.handle, list(tokens)))
        return super().prefill_all_logits(kv, tokens)

    def can_prefill_together(self) -> bool:
        return super().can_prefill_together()

    def prefill_together(self, kvs, chunks, want_logits=True):
        handles = [kv.handle for kv in kvs]
        self._send(("together", handles, [list(c) for c in chunks], want_logits))
        return super().prefill_together(kvs, chunks, want_logits)

    def decode(self, batch, tokens):
        if isinstance(tokens, mx.array):  # the plan carries token ids, not device arrays
            tokens = tokens.tolist()
        self._send(("decode", list(tokens)))
        return super().decode(batch, tokens)

    def join_batch(self, batch, kv, rows) -> None:
        self._send(("join", kv.handle))
        super().join_batch(batch, kv, rows)

    def keep_rows(self, batch, rows: list[int]) -> None:
        self._send(("keep", list(rows)))
        super().keep_rows(batch, rows)


class Replayer:
    """A follower rank's loop: the same runner calls as rank 0, on its own shard."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.kvs: dict[int, list] = {}
        self.batch = runner.new_batch_kv()
        self.steps = 0

    def apply(self, op: tuple) -> bool:
        """Runs one op; False when rank 0 says stop."""
        kind = op[0]
        r = self.runner
        if kind == "new":
            self.kvs[op[1]] = r.new_sequence_kv()
        elif kind == "release":
            for h in op[1]:
                self.kvs.pop(h, None)
        elif kind == "prefill":
            kv = self.kvs[op[1]]
            out = r.prefill(kv, op[2], op[3])
            mx.eval(out if out is not None else kv.arrays())
        elif kind == "all_logits":
            mx.eval(r.prefill_all_logits(self.kvs[op[1]], op[2]))
        elif kind == "together":
            kvs = [self.kvs[h] for h in op[1]]
            out = r.prefill_together(kvs, op[2], op[3])
            mx.eval(out if out is not None else [a for kv in kvs for a in kv.arrays()])
        elif kind == "decode":
            self.steps += 1
            mx.eval(r.decode(self.batch, op[1]))
        elif kind == "join":
            kv = self.kvs[op[1]]
            r.join_batch(self.batch, kv, kv.rows())
        elif kind == "keep":
            r.keep_rows(self.batch, op[1])
        elif kind == "stop":
            return False
        else:
            raise ValueError(f"unknown tensor-parallel op {kind!r}")
        return True
