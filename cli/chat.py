"""Chat in the terminal, streaming, with a running server or a model started here.

    markbase chat                                  # starts smollm2-135m-instruct here
    markbase chat --model gemma3-270m              # any alias, .gguf file or folder
    markbase chat --url http://127.0.0.1:8000      # a running server (--model picks one of its)

Type a message and Enter. Commands: /reset (new conversation), /system TEXT, /help,
/exit (or Ctrl-D). Ctrl-C stops an answer being written. Answers go to standard output,
the tokens/s line to standard error, so ``markbase chat < questions.txt`` prints
just the answers.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import dataclass, field

import httpx

DEFAULT_MODEL = "smollm2-135m-instruct"
HELP = "/reset  new conversation · /system TEXT  set the system prompt · /exit  quit"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", help="base URL of a running server (default: start one here)")
    p.add_argument(
        "--model",
        help=f"with --url: the served model id (default: the first); without: the model to "
        f"load here, an alias, .gguf file or folder (default: {DEFAULT_MODEL})",
    )
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (or OPENAI_API_KEY)"
    )
    p.add_argument("--system", default="", help="system prompt")
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--quiet", action="store_true", help="no tokens/s line after each answer")


@dataclass
class Answer:
    text: str = ""
    completion_tokens: int | None = None
    ttft_s: float | None = None
    tok_s: float | None = None
    finish_reason: str | None = None
    stopped: bool = False


class ChatError(Exception):
    pass


def error_text(response: httpx.Response) -> str:
    try:
        e = json.loads(response.read()).get("error", {})
        return f"HTTP {response.status_code} {e.get('code') or e.get('type') or ''}: {e.get('message')}"
    except (ValueError, AttributeError):
        return f"HTTP {response.status_code}: {response.text[:500]}"


@dataclass
class Chat:
    client: httpx.Client
    model: str
    params: dict
    system: str = ""
    history: list[dict] = field(default_factory=list)

    def messages(self, user: str) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history, {"role": "user", "content": user}]

    def ask(self, user: str, out) -> Answer:
        """Stream the answer to ``user`` into ``out``; keeps the turn in the history
        unless it failed. Ctrl-C stops the answer (the stream is closed, which frees
        the server's slot) and keeps what was written."""
        body = {
            "model": self.model,
            "messages": self.messages(user),
            "stream": True,
            "stream_options": {"include_usage": True},
            **self.params,
        }
        ans = Answer()
        t0 = time.monotonic()
        t_first = None
        try:
            with self.client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    raise ChatError(error_text(r))
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise ChatError(chunk["error"].get("message", str(chunk["error"])))
                    if chunk.get("usage"):
                        ans.completion_tokens = chunk["usage"]["completion_tokens"]
                    for choice in chunk.get("choices") or []:
                        piece = (choice.get("delta") or {}).get("content")
                        if piece:
                            if t_first is None:
                                t_first = time.monotonic()
                            ans.text += piece
                            out.write(piece)
                            out.flush()
                        if choice.get("finish_reason"):
                            ans.finish_reason = choice["finish_reason"]
        except KeyboardInterrupt:
            ans.stopped = True
        except httpx.HTTPError as e:
            raise ChatError(f"cannot reach the server: {e}") from None
        end = time.monotonic()
        if t_first is not None:
            ans.ttft_s = t_first - t0
            n = ans.completion_tokens
            if n and n > 1 and end > t_first:
                ans.tok_s = (n - 1) / (end - t_first)
        self.history += [
            {"role": "user", "content": user},
            {"role": "assistant", "content": ans.text},
        ]
        return ans


def stats_line(ans: Answer) -> str:
    bits = []
    if ans.completion_tokens is not None:
        bits.append(f"{ans.completion_tokens} tokens")
    if ans.tok_s:
        bits.append(f"{ans.tok_s:.1f} tok/s")
    if ans.ttft_s is not None:
        bits.append(f"TTFT {ans.ttft_s * 1000:.0f} ms")
    if ans.stopped:
        bits.append("stopped")
    elif ans.finish_reason and ans.finish_reason != "stop":
        bits.append(f"finish: {ans.finish_reason}")
    return "[" + ", ".join(bits) + "]"


def _dim(text: str, stream) -> str:
    return f"\033[2m{text}\033[0m" if stream.isatty() else text


def served_model(client: httpx.Client, wanted: str | None) -> str:
    try:
        r = client.get("/v1/models")
    except httpx.HTTPError as e:
        raise ChatError(f"cannot reach {client.base_url}: {e}") from None
    if r.status_code != 200:
        raise ChatError(error_text(r))
    ids = [m["id"] for m in r.json()["data"]]
    if wanted is None:
        if not ids:
            raise ChatError("the server serves no model")
        return ids[0]
    if wanted not in ids:
        raise ChatError(f"the server does not serve {wanted!r}; it serves: {', '.join(ids)}")
    return wanted


def repl(chat: Chat, quiet: bool) -> int:
    interactive = sys.stdin.isatty()
    if interactive:
        try:
            import readline  # noqa: F401 - line editing and history for input()
        except ImportError:
            pass
        print(_dim(f"markbase chat with {chat.model} · {HELP}", sys.stdout))
    while True:
        try:
            line = input("\033[1myou>\033[0m " if interactive else "")
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/help":
            print(HELP)
            continue
        if text == "/reset":
            chat.history.clear()
            print(_dim("(new conversation)", sys.stdout))
            continue
        if text.startswith("/system"):
            chat.system = text[len("/system") :].strip()
            chat.history.clear()
            print(_dim("(system prompt set; new conversation)", sys.stdout))
            continue
        if interactive:
            sys.stdout.write("\033[1m" + chat.model + ">\033[0m ")
        try:
            ans = chat.ask(line, sys.stdout)
        except ChatError as e:
            sys.stdout.write("\n" if interactive else "")
            print(f"error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not quiet:
            print(_dim(stats_line(ans), sys.stderr), file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    params = {
        k: v
        for k, v in (
            ("temperature", args.temperature),
            ("top_p", args.top_p),
            ("max_tokens", args.max_tokens),
            ("seed", args.seed),
        )
        if v is not None
    }
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}

    def session(url: str, model: str | None) -> int:
        with httpx.Client(
            base_url=url, headers=headers, timeout=httpx.Timeout(600, connect=10)
        ) as client:
            try:
                name = served_model(client, model)
            except ChatError as e:
                print(f"markbase chat: {e}", file=sys.stderr)
                return 1
            return repl(Chat(client, name, params, system=args.system), args.quiet)

    if args.url:
        return session(args.url.rstrip("/"), args.model)

    from cli.main import prepare_mlx

    prepare_mlx()  # before MLX loads
    from cli.local_server import local_server
    from engine.loading import ModelLoadError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("markbase.progress").setLevel(logging.INFO)
    source = args.model or DEFAULT_MODEL
    print(_dim(f"loading {source} ...", sys.stderr), file=sys.stderr, flush=True)
    t0 = time.monotonic()
    try:
        with local_server([source]) as url:
            print(
                _dim(f"ready in {time.monotonic() - t0:.1f} s", sys.stderr),
                file=sys.stderr,
                flush=True,
            )
            return session(url, None)
    except ModelLoadError as e:
        print(f"markbase chat: cannot load model: {e}", file=sys.stderr)
        return 1
