"""Rank 0 of a tensor-parallel model: starts the follower ranks, joins the group with
them, loads and shards its own copy, and watches the followers for as long as it serves.

``markbase serve --tensor-parallel N`` runs N processes on this host: this one (rank 0:
HTTP, scheduler, sampling) and N - 1 followers (``engine.distributed.follower``), one
per GPU on NVIDIA (NCCL) or all on the CPU (MLX's ring backend over 127.0.0.1).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from engine import platform
from engine.distributed.channel import Leader, RankLostError
from engine.distributed.group import RankSpec, join_group, shard_model, write_hostfile

log = logging.getLogger("markbase.tp")

START_TIMEOUT_S = 600.0  # loading a large model on every rank takes a while


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _backend() -> str:
    return "nccl" if platform.on_gpu() else "ring"


class TensorParallelGroup:
    """The follower processes, the control channel to them, and the watchdog."""

    def __init__(self, size: int, procs: list[subprocess.Popen], leader: Leader, tmp) -> None:
        self.size = size
        self.procs = procs
        self.leader = leader
        self._tmp = tmp
        self._stop = threading.Event()
        self._watch: threading.Thread | None = None

    @classmethod
    def start(cls, model_config, size: int) -> tuple[TensorParallelGroup, object]:
        """Starts ranks 1..size-1, joins them as rank 0, loads and shards the model on
        every rank; returns the group and rank 0's loaded (sharded) model."""
        from engine.loading import ModelLoadError, load_model

        backend = _backend()
        tmp = tempfile.TemporaryDirectory(prefix="markbase-tp-")
        hostfile = Path(tmp.name) / "hosts.json"
        ports = _free_ports(size + 1)
        write_hostfile(hostfile, ports[:size])
        leader = Leader(size)
        model_json = json.dumps(
            {k: v for k, v in asdict(model_config).items() if k != "max_context"}
        )
        procs = []
        for rank in range(1, size):
            spec = RankSpec(rank, size, backend, str(hostfile), nccl_port=ports[size])
            cmd = [
                sys.executable, "-m", "engine.distributed.follower",
                "--spec", spec.to_json(), "--model", model_json,
                "--control", f"{leader.address[0]}:{leader.address[1]}",
            ]  # fmt: skip
            env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
            procs.append(subprocess.Popen(cmd, env=env))
        group = cls(size, procs, leader, tmp)
        try:
            spec0 = RankSpec(0, size, backend, str(hostfile), nccl_port=ports[size])
            log.info("tensor parallel: %d ranks over %s", size, backend)
            mx_group = join_group(spec0)
            t0 = time.monotonic()
            loaded = load_model(
                model_config.source,
                name=model_config.name,
                weight_format=model_config.weight_format,
            )
            shard_model(loaded, mx_group)
            hellos = leader.accept(START_TIMEOUT_S, group._check_alive)
            bad = [msg for msg in hellos.values() if msg != "ok"]
            if bad:
                raise ModelLoadError("; ".join(str(b) for b in bad))
            log.info(
                "loaded and sharded %s over %d ranks in %.1f s",
                loaded.name,
                size,
                time.monotonic() - t0,
            )
        except BaseException:
            group.close()
            raise
        return group, loaded

    def _check_alive(self) -> None:
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankLostError(f"tensor-parallel rank {rank} exited with code {code}")

    def watch(self, on_lost: Callable[[RankLostError], None], every_s: float = 0.2) -> None:
        """Calls ``on_lost`` once, from a watchdog thread, when a follower exits."""

        def loop() -> None:
            while not self._stop.wait(every_s):
                try:
                    self._check_alive()
                except RankLostError as exc:
                    if self._stop.is_set():
                        return
                    log.error("%s: the model cannot run any more", exc)
                    self.leader.mark_lost(str(exc))
                    on_lost(exc)
                    return

        self._watch = threading.Thread(target=loop, name="markbase-tp-watchdog", daemon=True)
        self._watch.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Tells the followers to stop, then waits for them (killing stragglers)."""
        self._stop.set()
        try:
            self.leader.send(("stop",))
        except RankLostError:
            pass
        self.leader.close()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._tmp.cleanup()
