"""Per client address, the bytes of its refused requests: a flood of refused large
bodies is slowed down before it costs the server its cores.

Refusing a 1 MB prompt that cannot fit the context costs the server ~3.5 ms of CPU
(h11 reading the body, JSON, validation) even without tokenizing it. A client that
sends such prompts on 16 connections as fast as they are refused gets ~190 refusals
a second on two cores: half a core taken from the running streams (their p99
inter-token gap 2.5x their quiet one, bench/serve/hostile.py). Refusing faster only
makes a closed-loop flooder send faster.

``RefusalThrottle`` counts, per client IP, the request bytes received (head and body,
up to the answer) of the answers with a 4xx status over the last ``window_s``; a
declared length alone costs nothing and counts nothing.
Once an address has ``budget_bytes`` of them, server.connections holds its next
POSTs: their bodies are not read, and after ``refusal_delay_s`` they are answered
429 ``too_many_refusals`` with ``Retry-After`` and closed. Holding costs a timer, not
CPU, and bounds a closed-loop flooder to one request per connection per delay. Small
mistakes do not add up to the budget (the default is 16 MiB in 10 s: 17 refused 1 MB
prompts, or thousands of refused small requests); held requests do not count, so an
address that stops is served again once its window has passed.

Behind a reverse proxy every client has the proxy's address: turn it off there
(``refused_bytes_per_client: 0``) and limit clients in the proxy.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_ADDRESSES = 4096  # addresses tracked before stale ones are dropped


def counts_as_refusal(status: int) -> bool:
    """A 4xx answer: the client's request was refused (not a server fault)."""
    return 400 <= status < 500


@dataclass
class RefusalThrottle:
    budget_bytes: int = 16 * 1024 * 1024  # 0: off
    window_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    _seen: dict[str, deque] = field(default_factory=dict)  # ip -> (when, bytes)
    _total: dict[str, int] = field(default_factory=dict)  # ip -> bytes in the window

    def record(self, ip: str | None, status: int, nbytes: int) -> None:
        """An answer with ``status`` to a request of ``nbytes`` from ``ip``."""
        if not self.budget_bytes or ip is None or not counts_as_refusal(status):
            return
        now = self.clock()
        if ip not in self._seen and len(self._seen) >= MAX_ADDRESSES:
            for other in list(self._seen):
                self._trim(other, now)
        self._seen.setdefault(ip, deque()).append((now, nbytes))
        self._total[ip] = self._total.get(ip, 0) + nbytes
        self._trim(ip, now)

    def throttled(self, ip: str | None) -> bool:
        """Whether ``ip``'s refused bytes in the window reach the budget."""
        if not self.budget_bytes or ip is None or ip not in self._seen:
            return False
        self._trim(ip, self.clock())
        return self._total.get(ip, 0) >= self.budget_bytes

    def _trim(self, ip: str, now: float) -> None:
        q = self._seen[ip]
        while q and q[0][0] <= now - self.window_s:
            self._total[ip] -= q.popleft()[1]
        if not q:
            del self._seen[ip], self._total[ip]
