"""The control channel of a tensor-parallel model: rank 0 tells the other ranks, in
order, every operation that touches the model or its KV caches.

A loopback TCP socket per follower carrying length-prefixed pickles. Pickle is safe
here because both ends are processes that rank 0 started itself and the listener
accepts only the followers it is waiting for, on 127.0.0.1, before serving begins.
Collectives (all-reduces inside the forward) run over MLX's own distributed backend;
this channel only carries the plan: which op, on which sequence, with which tokens.
"""

from __future__ import annotations

import pickle
import socket
import struct
import threading

_HEADER = struct.Struct("!I")


class RankLostError(BaseException):
    """A tensor-parallel rank is gone: the model cannot run another step.

    A BaseException, not an Exception: the worker's per-request handlers must not
    swallow it; it ends the worker loop, which fails every request as ``engine_dead``
    and turns ``/health`` to 503."""


def send_msg(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_msg(sock: socket.socket):
    head = _recv_exact(sock, _HEADER.size)
    (size,) = _HEADER.unpack(head)
    return pickle.loads(_recv_exact(sock, size))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the peer closed the control channel")
        buf += chunk
    return bytes(buf)


class Leader:
    """Rank 0's end: accepts ``size - 1`` followers, then sends each op to all."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = self._listener.getsockname()
        self._peers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self.lost: str | None = None  # why a rank is gone, once one is

    def accept(self, timeout_s: float, alive) -> dict[int, object]:
        """Waits for every follower's hello (its rank, and its load result);
        ``alive()`` raises when a follower process exited meanwhile."""
        self._listener.settimeout(0.5)
        hellos: dict[int, object] = {}
        import time

        deadline = time.monotonic() + timeout_s
        while len(self._peers) < self.size - 1:
            alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only {len(self._peers)} of {self.size - 1} tensor-parallel ranks "
                    f"reported within {timeout_s:.0f} s"
                )
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            rank, result = recv_msg(conn)
            self._peers[rank] = conn
            hellos[rank] = result
        self._listener.close()
        return hellos

    def send(self, op: tuple) -> None:
        with self._lock:
            if self.lost is not None:
                raise RankLostError(self.lost)
            for rank, sock in self._peers.items():
                try:
                    send_msg(sock, op)
                except OSError as exc:
                    self.lost = f"tensor-parallel rank {rank} is gone ({exc})"
                    raise RankLostError(self.lost) from None

    def mark_lost(self, why: str) -> None:
        with self._lock:
            if self.lost is None:
                self.lost = why

    def close(self) -> None:
        with self._lock:
            for sock in self._peers.values():
                try:
                    sock.close()
                except OSError:
                    pass
            self._peers.clear()


class FollowerChannel:
    """A follower's end: says hello once, then reads ops until rank 0 closes it."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def hello(self, rank: int, result) -> None:
        send_msg(self.sock, (rank, result))

    def recv(self):
        return recv_msg(self.sock)
