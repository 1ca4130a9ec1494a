"""``markbase COMMAND``: one entry point for everything a user runs.

    markbase serve    [--model SRC ...] [--host H] [--port P] ...   the HTTP server (server.cli)
    markbase chat     [--url URL | --model SRC] ...                 chat in the terminal
    markbase models   [--config FILE] [--url URL]                   packaged, configured, cached
    markbase bench    [--servers a,b] [--concurrency 1,2,4] ...     serving benchmark + PNG plot
    markbase quantize SRC DST --bits 4 --group-size 64              write an mlx-lm folder

``serve`` keeps its own parser (every setting has a flag); the others are here. A
command that runs a model in this process binds the fast BLAS before MLX loads, as
``serve`` does.
"""

from __future__ import annotations

import argparse
import os
import sys

COMMANDS = {
    "serve": "serve one or more models over HTTP (OpenAI API, chat page at /)",
    "chat": "chat in the terminal with a running server or a model started here",
    "models": "list the models packaged, configured and cached here, with sizes",
    "bench": "benchmark serving against installed peers; print the table, plot a PNG",
    "quantize": "quantize a model to an mlx-lm folder the server loads",
}


def prepare_mlx() -> None:
    """Before anything imports MLX: CUDA's kernel cache and attention choice, and the
    fast CPU BLAS (no-ops where they do not apply), as ``markbase serve`` does."""
    from engine.backends import cpu, cuda

    cuda.default_ptx_cache_dir()
    cuda.default_cuda_attention()
    cpu.ensure_fast_blas()


def build_parser() -> argparse.ArgumentParser:
    from cli import bench, chat, models, quantize

    parser = argparse.ArgumentParser(
        prog="markbase",
        description="OpenAI-compatible LLM server on MLX, and the tools around it.",
        epilog="`markbase serve --help` lists every server setting.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    sub.add_parser("serve", help=COMMANDS["serve"], add_help=False)
    for name, module in (
        ("chat", chat),
        ("models", models),
        ("bench", bench),
        ("quantize", quantize),
    ):
        p = sub.add_parser(name, help=COMMANDS[name], description=module.__doc__.split("\n\n")[0])
        module.add_arguments(p)
        p.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from server.cli import main as serve_main

        return serve_main(argv)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except BrokenPipeError:  # `markbase models | head`: the reader left, nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
