#!/usr/bin/env python
"""What a new user sees in the first minute: time from the start command to the chat
page answering.

Runs the start command (default ``make serve``, with a free port), then measures from
its launch: the server healthy, ``GET /`` serving the page, the first streamed token of
a chat answer over the API, and, with Debian's chromium + chromedriver, the page opened
in headless Chromium with a question typed and its whole answer shown.

    .venv/bin/python bench/serve/first_minute.py                           # make serve
    .venv/bin/python bench/serve/first_minute.py --cmd ".venv/bin/markbase serve --port {port}"

``{port}`` in --cmd is replaced by a free port (``make serve`` gets ``PORT=``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.helpers.server import free_port  # noqa: E402

QUESTION = "What is the capital of France?"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--cmd", default="make serve PORT={port}", help="start command ({port}: a free port)"
    )
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--no-browser", action="store_true")
    args = p.parse_args(argv)
    port = free_port()
    cmd = args.cmd.replace("{port}", str(port))
    url = f"http://127.0.0.1:{port}"
    results = REPO / "bench" / "results" / "serve"
    results.mkdir(parents=True, exist_ok=True)
    log = open(results / "first-minute-server.log", "wb")  # noqa: SIM115 - open while it runs
    t0 = time.monotonic()
    proc = subprocess.Popen(
        shlex.split(cmd), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    marks: dict[str, float] = {}
    try:
        while "page" not in marks:
            if proc.poll() is not None:
                raise SystemExit(f"{cmd!r} exited with {proc.returncode}")
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit("not ready in time")
            try:
                if (
                    "health" not in marks
                    and httpx.get(url + "/health", timeout=2).status_code == 200
                ):
                    marks["health"] = time.monotonic() - t0
                if "health" in marks and httpx.get(url + "/", timeout=2).status_code == 200:
                    marks["page"] = time.monotonic() - t0
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        body = {
            "model": model,
            "messages": [{"role": "user", "content": QUESTION}],
            "temperature": 0,
            "max_tokens": 24,
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
            for line in r.iter_lines():
                if (
                    line.startswith("data:")
                    and '"content":"' in line
                    and "api_first_token" not in marks
                ):
                    marks["api_first_token"] = time.monotonic() - t0
        marks["api_answer"] = time.monotonic() - t0
        if not args.no_browser:
            marks.update(browser_answer(url, t0))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"start command: {cmd}")
    print(
        f"machine: {os.cpu_count()} CPUs, {platform.platform()}; load avg {os.getloadavg()[0]:.2f}; "
        f"{time.strftime('%Y-%m-%d %H:%M')}"
    )
    print()
    print("| step (seconds after the start command) | s |")
    print("|---|---:|")
    names = {
        "health": "server healthy (/health 200)",
        "page": "chat page served (GET / 200)",
        "api_first_token": "first streamed token over the API",
        "api_answer": "whole API answer",
        "browser_page": "page open in Chromium, model list filled",
        "browser_first_token": "question typed in the page, first words shown",
        "browser_answer": "whole answer shown (page defaults: temperature 0.7, max 512 tokens)",
    }
    for key, label in names.items():
        if key in marks:
            print(f"| {label} | {marks[key]:.1f} |")
    if "browser_answer_tokens" in marks:
        print(f"\n(the page's answer had {marks['browser_answer_tokens']:.0f} tokens)")
    print()
    print(json.dumps({k: round(v, 2) for k, v in marks.items()}))
    return 0


def browser_answer(url: str, t0: float) -> dict[str, float]:
    from tests.ui.browser import chromium, find_binaries

    if find_binaries() is None:
        return {}
    from selenium.webdriver.common.by import By

    out = {}
    with chromium() as d:
        d.get(url + "/")
        while not d.execute_script("return document.querySelectorAll('#model option').length"):
            time.sleep(0.05)
        out["browser_page"] = time.monotonic() - t0
        d.find_element(By.ID, "prompt").send_keys(QUESTION + "\n")
        answer = "const m = window.markbaseChat.current().messages; return m.length > 1 ? m[m.length - 1] : null"
        last = (
            "const e = document.querySelector('.msg[data-last=\"1\"]'); return e && e.dataset.state"
        )
        while not (d.execute_script(answer) or {}).get("content"):
            time.sleep(0.02)
        out["browser_first_token"] = time.monotonic() - t0
        while d.execute_script(last) != "done":
            time.sleep(0.05)
        out["browser_answer"] = time.monotonic() - t0
        out["browser_answer_tokens"] = d.execute_script(answer)["meta"]["completion_tokens"]
    return out


if __name__ == "__main__":
    raise SystemExit(main())
