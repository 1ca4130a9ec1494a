"""``markbase serve``: read settings, start the engine, serve the API.

    markbase serve --model smollm2-135m-instruct [--model NAME=SRC ...]
                   [--host H] [--port P] [--config FILE] [--api-key KEY ...]
                   [--max-num-seqs N] [any other setting as --some-setting]

Every field of ServerSettings and EngineConfig has a flag (``max_num_seqs`` ->
``--max-num-seqs``); flags beat ``MARKBASE_*`` variables, which beat the YAML.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import signal
import sys
import threading
import time
import typing
from typing import Any

import uvicorn

from engine import envs
from engine.backends import cpu, cuda
from engine.config import EngineConfig
from server import prompt_guard
from server.config import ConfigError, ServerSettings, load_settings, parse_model_arg, redacted
from server.connections import ConnectionLimits, raise_open_file_limit, uvicorn_options

log = logging.getLogger("markbase.server")

_EXPLICIT = {"host", "port", "api_keys", "models"}


def _add_setting_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in _EXPLICIT:
            continue
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        help_text = f"(default: {default})"
        if hint is bool or set(typing.get_args(hint)) == {bool, type(None)}:
            group.add_argument(
                flag,
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif typing.get_origin(hint) is list:
            group.add_argument(
                flag,
                dest=f.name,
                action="append",
                default=None,
                metavar="VALUE",
                help=f"repeatable or comma-separated {help_text}",
            )
        else:
            typ = hint if hint in (int, float, str) else str
            group.add_argument(flag, dest=f.name, type=typ, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="markbase", description="OpenAI-compatible LLM server on MLX"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve one or more models over HTTP")
    serve.add_argument(
        "--model",
        action="append",
        metavar="[NAME=]SRC",
        help="model alias, .gguf file or folder; repeat to serve several",
    )
    serve.add_argument(
        "--max-context", type=int, default=None, help="cap the context window of the --model models"
    )
    serve.add_argument(
        "--weight-format", default=None, help="weight format of the --model models (default: auto)"
    )
    serve.add_argument(
        "--config", default=None, metavar="FILE", help="YAML settings file (or MARKBASE_CONFIG)"
    )
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=None,
        metavar="KEY",
        help="require Bearer KEY on /v1/*; repeatable or comma-separated (or MARKBASE_API_KEY)",
    )
    _add_setting_flags(serve, ServerSettings, "server settings")
    _add_setting_flags(serve, EngineConfig, "engine settings")
    return parser


def _split(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    skip = {"command", "config", "model", "max_context", "weight_format"}
    list_fields = {
        f.name
        for cls in (ServerSettings, EngineConfig)
        for f in dataclasses.fields(cls)
        if typing.get_origin(typing.get_type_hints(cls)[f.name]) is list
    }
    for key, value in vars(args).items():
        if key in skip or value is None:
            continue
        out[key] = _split(value) if key in list_fields else value
    if args.model:
        out["models"] = [parse_model_arg(m) for m in args.model]
    return out


def _apply_model_flags(settings: Any, args: argparse.Namespace) -> None:
    for m in settings.engine.models:
        if args.max_context is not None:
            m.max_context = args.max_context
        if args.weight_format is not None:
            m.weight_format = args.weight_format


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def serve(args: argparse.Namespace) -> int:
    try:
        settings = load_settings(args.config, overrides=overrides_from_args(args))
        _apply_model_flags(settings, args)
    except ConfigError as exc:
        print(f"markbase: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.server.log_level)
    log.info("settings: %s", redacted(settings))

    from engine.client import EngineClient  # imported here: the engine pulls in MLX
    from engine.loading import ModelLoadError
    from server.app import create_app

    try:
        engine = EngineClient.start(settings.engine)
    except ModelLoadError as exc:  # names the file and tensor: the message is enough
        print(f"markbase: cannot load model: {exc}", file=sys.stderr)
        return 1
    try:
        app = create_app(engine, settings)
        prompt_guard.prepare(engine)
        warn_open_metrics(settings.server)
        limits = ConnectionLimits.from_settings(settings.server)
        raise_open_file_limit(limits)
        grace = settings.server.shutdown_grace_s
        config = uvicorn.Config(
            app,
            host=settings.server.host,
            port=settings.server.port,
            log_level=settings.server.log_level.lower(),
            access_log=False,  # markbase.access logs one line per request instead
            timeout_graceful_shutdown=grace + 5,  # after the engine's abort, streams end at once
            **uvicorn_options(limits),  # per-phase timeouts, connection caps (server.connections)
        )
        # uvicorn re-raises the signal that stopped it once it is done; these
        # handlers turn that into a clean exit (status 0, engine shut down).
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, _stopped)
        with contextlib.suppress(_Stopped):
            DrainingServer(config, engine, grace).run()
    finally:
        engine.shutdown()
        from engine.worker import release_mlx_thread_state

        release_mlx_thread_state()  # before the interpreter finalizes: no SIGABRT at exit
    return 0


def warn_open_metrics(server: ServerSettings) -> None:
    """API keys guard /v1/*; /metrics stays open unless metrics_require_auth is set,
    which is easy to miss when the server is exposed."""
    if server.api_keys and not server.metrics_require_auth:
        log.warning(
            "API keys are set but /metrics is open to anyone who can reach %s:%d "
            "(model names, request counts, queue lengths); set metrics_require_auth: true "
            "(--metrics-require-auth) to require a key there too",
            server.host,
            server.port,
        )


class _Stopped(Exception):
    pass


def _stopped(signum: int, frame: Any) -> None:
    raise _Stopped(signum)


class DrainingServer(uvicorn.Server):
    """On the first SIGINT/SIGTERM, requests in flight get ``grace`` seconds to
    finish; then the engine is shut down, which ends every remaining sequence
    with an error the client sees (an SSE error event and ``[DONE]``, or a 503)
    instead of a connection cut when uvicorn gives up waiting."""

    def __init__(self, config: uvicorn.Config, engine: Any, grace: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.grace = grace

    def handle_exit(self, sig: int, frame: Any) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first:
            log.info("shutting down: %.0f s for requests in flight", self.grace)
            threading.Thread(
                target=_stop_engine_after, args=(self.engine, self.grace), daemon=True
            ).start()


def _stop_engine_after(engine, grace: float) -> None:
    time.sleep(grace)
    engine.stop_workers()  # not shutdown(): this thread never used MLX


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        # Before anything imports MLX: keep CUDA's compiled kernels in a per-user
        # cache and use MLX's own attention, not cuDNN's (no-ops elsewhere), bind its CPU matmuls to a fast BLAS (no-op on
        # macOS and CUDA builds). The HTTP layer itself never imports MLX.
        for name in envs.unknown():
            log.warning("unknown environment variable %s: markbase reads no such setting "
                        "(docs/configuration.md lists them)", name)  # fmt: skip
        for why in envs.invalid():
            log.error("%s", why)
            return 2
        cuda.default_ptx_cache_dir()
        cuda.default_cuda_attention()  # no cuDNN graph build per prompt length (CUDA only)
        cpu.ensure_fast_blas()
        return serve(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
