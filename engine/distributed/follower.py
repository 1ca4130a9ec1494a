"""A follower rank of a tensor-parallel model: ``python -m engine.distributed.follower``.

Started by rank 0 (``markbase serve --tensor-parallel N``), never by hand. It joins the
group, loads and shards the same model, says hello on the control channel (``ok``
or why it could not load), then replays rank 0's operations until rank 0 closes the
channel (shutdown, or rank 0 gone), and exits.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

log = logging.getLogger("markbase.tp")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="markbase-tp-follower")
    parser.add_argument("--spec", required=True, help="RankSpec as JSON")
    parser.add_argument("--model", required=True, help="ModelConfig fields as JSON")
    parser.add_argument("--control", required=True, help="rank 0's control address host:port")
    args = parser.parse_args(argv)
    # Ctrl-C in a terminal reaches the whole process group: rank 0 decides when the
    # followers stop (it closes the control channel), so they ignore it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    from engine.backends import cpu

    cpu.ensure_fast_blas(allow_reexec=False)
    from engine.distributed.channel import FollowerChannel
    from engine.distributed.group import RankSpec, join_group, shard_model
    from engine.distributed.lockstep import Replayer

    spec = RankSpec.from_json(args.spec)
    host, port = args.control.rsplit(":", 1)
    model_cfg = json.loads(args.model)
    group = join_group(spec)
    channel = FollowerChannel((host, int(port)))
    try:
        from engine.loading import load_model
        from engine.runner import ModelRunner

        loaded = load_model(
            model_cfg["source"],
            name=model_cfg.get("name"),
            weight_format=model_cfg["weight_format"],
        )
        shard_model(loaded, group)
        runner = ModelRunner(loaded.model, None, fused_decode=False, check=False)
    except Exception as exc:  # noqa: BLE001 - rank 0 reports it as the load error
        log.exception("rank %d could not load the model", spec.rank)
        channel.hello(spec.rank, f"rank {spec.rank}: {exc}")
        return 1
    channel.hello(spec.rank, "ok")
    replayer = Replayer(runner)
    try:
        while replayer.apply(channel.recv()):
            pass
    except ConnectionError:
        pass  # rank 0 closed the channel: the server is gone or shutting down
    log.info("rank %d done after %d decode steps", spec.rank, replayer.steps)
    from engine.worker import release_mlx_thread_state

    release_mlx_thread_state()
    return 0


if __name__ == "__main__":
    sys.exit(main())
