"""The chat page and the dashboard in a real browser (headless Chromium) against a
real ``markbase serve`` with SmolLM2: typed questions, streamed answers, Stop, a
second turn, a 429, and the dashboard's plots after that traffic.

The server runs with two sequence slots and a queue of one, so a 429 takes three
requests in flight. Screenshots of both pages go to ``--screenshots DIR`` (the
committed ones in docs/img/ come from ``pytest tests/ui --screenshots docs/img``),
else to a temporary folder.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.server import running_server
from tests.ui.browser import chromium, find_binaries

pytestmark = pytest.mark.slow

if find_binaries() is None:
    pytest.skip(
        "needs chromium and chromedriver (Debian: chromium chromium-driver; `make test` installs them)",
        allow_module_level=True,
    )
pytest.importorskip("selenium")

from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.select import Select  # noqa: E402

MODEL = "smollm2-135m-instruct"
FIRST = "Write a Python function that adds two numbers."
SECOND = "Now make it add three numbers."
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server():
    with running_server(MODEL, "--max-num-seqs", "2", "--max-queued-requests", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    with chromium() as driver:
        yield driver


@pytest.fixture(scope="module")
def shots(request, tmp_path_factory) -> Path:
    out = request.config.getoption("--screenshots", default=None)
    path = Path(out) if out else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


def wait_for(fn, timeout: float = 60.0, every: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = fn()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def last_state(d) -> str | None:
    return d.execute_script(
        "const e = document.querySelector('.msg[data-last=\"1\"]'); return e ? e.dataset.state : null"
    )


def messages(d) -> list[dict]:
    return d.execute_script("return window.markbaseChat.current().messages")


def open_chat(d, server, temperature: str = "0", max_tokens: int = MAX_TOKENS) -> None:
    """A fresh page, a new conversation, the given sampling settings."""
    d.get(server.url + "/")
    wait_for(
        lambda: d.execute_script("return document.querySelectorAll('#model option').length") > 0,
        what="the model list",
    )
    d.find_element(By.ID, "new-chat").click()
    d.find_element(By.ID, "toggle-settings").click()
    for field, value in (("temperature", temperature), ("max_tokens", str(max_tokens))):
        box = d.find_element(By.ID, field)
        box.clear()
        box.send_keys(value)
    d.find_element(By.ID, "close-settings").click()


def ask(d, text: str) -> None:
    box = d.find_element(By.ID, "prompt")
    box.send_keys(text)
    d.find_element(By.ID, "send").click()


def api_answer(server, messages_: list[dict], max_tokens: int = MAX_TOKENS) -> str:
    r = httpx.post(
        server.v1 + "/chat/completions",
        json={"model": MODEL, "messages": messages_, "temperature": 0, "max_tokens": max_tokens},
        timeout=120,
    )
    r.raise_for_status()
    return r.json()["choices"][0]["message"]["content"]


def running(server) -> tuple[int, int]:
    stats = httpx.get(server.url + "/health", timeout=5).json()["models"][MODEL]
    return stats["running"] + stats["prefilling"], stats["waiting"]


def js_errors(d) -> list[str]:
    return [e["message"] for e in d.get_log("browser") if e.get("source") == "javascript"]


def test_page_loads_with_the_served_model(server, browser):
    browser.get(server.url + "/")
    options = wait_for(
        lambda: browser.execute_script(
            "return Array.from(document.querySelectorAll('#model option')).map(o => o.value)"
        ),
        what="the model list",
    )
    assert options == [MODEL]
    assert "8,192 tokens context" in browser.find_element(By.ID, "model-info").text
    assert browser.find_element(By.ID, "stop").is_displayed() is False
    assert js_errors(browser) == []


def test_streamed_answer_is_the_api_greedy_answer_and_a_second_turn_includes_the_first(
    server, browser, shots
):
    d = browser
    open_chat(d, server)
    ask(d, FIRST)
    lengths = set()

    def finished():
        msgs = messages(d)
        if len(msgs) == 2 and last_state(d) == "streaming":
            lengths.add(len(msgs[1]["content"]))
        return last_state(d) == "done" and len(msgs) == 2

    wait_for(finished, what="the first answer")
    first = messages(d)[1]["content"]
    assert len(lengths - {0}) >= 2, f"the answer did not arrive in pieces: {lengths}"
    assert first == api_answer(server, [{"role": "user", "content": FIRST}])
    meta = d.find_element(By.CSS_SELECTOR, '.msg[data-last="1"] .meta').text
    assert "tok/s" in meta and "TTFT" in meta and " tokens" in meta
    usage1 = messages(d)[1]["meta"]

    ask(d, SECOND)
    wait_for(lambda: len(messages(d)) == 4 and last_state(d) == "done", what="the second answer")
    second = messages(d)[3]["content"]
    history = [
        {"role": "user", "content": FIRST},
        {"role": "assistant", "content": first},
        {"role": "user", "content": SECOND},
    ]
    assert second == api_answer(server, history)
    usage2 = messages(d)[3]["meta"]
    assert usage2["prompt_tokens"] > usage1["prompt_tokens"] + usage1["completion_tokens"]
    # The rendered page shows the code block with its copy button.
    assert d.find_elements(By.CSS_SELECTOR, ".msg.assistant .codeblock .copy-code")
    assert js_errors(d) == []
    d.execute_script("document.getElementById('messages').scrollTop = 0")
    d.save_screenshot(str(shots / "chat.png"))


def test_stop_cancels_mid_stream_and_frees_the_slot(server, browser):
    d = browser
    open_chat(d, server, temperature="0.8", max_tokens=400)
    ask(d, "Tell me a long story about a dragon who learns to bake bread.")
    wait_for(
        lambda: last_state(d) == "streaming" and len(messages(d)[-1]["content"]) > 20,
        what="some streamed text",
    )
    assert running(server)[0] == 1
    d.find_element(By.ID, "stop").click()
    wait_for(lambda: last_state(d) == "stopped", timeout=10, what="the stopped state")
    stopped_at = time.monotonic()
    wait_for(lambda: running(server) == (0, 0), timeout=10, what="the server to free the slot")
    assert time.monotonic() - stopped_at < 10
    msg = messages(d)[-1]
    assert msg["meta"]["stopped"] is True
    assert 0 < msg["meta"]["completion_tokens"] < 400
    assert "stopped" in d.find_element(By.CSS_SELECTOR, '.msg[data-last="1"] .meta').text
    assert d.find_element(By.ID, "send").is_displayed()


def _hold_slot(server, started: threading.Event, release: threading.Event) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to one thousand."}],
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", server.v1 + "/chat/completions", json=body, timeout=120) as r:
        for _ in r.iter_lines():
            started.set()
            if release.is_set():
                return  # closing the stream aborts the request


@contextlib.contextmanager
def holding(server, n: int, streaming: int):
    """``n`` long streaming requests sent one after another, held open while inside;
    the first ``streaming`` of them have sent a chunk before the block starts."""
    release = threading.Event()
    holders = []
    try:
        for i in range(n):
            started = threading.Event()
            t = threading.Thread(target=_hold_slot, args=(server, started, release), daemon=True)
            t.start()
            holders.append(t)
            if i < streaming:
                assert started.wait(60), "a holding request did not start"
        yield
    finally:
        release.set()
        for t in holders:
            t.join(60)


def test_a_429_shows_the_servers_message(server, browser):
    d = browser
    open_chat(d, server)
    with holding(server, 3, streaming=2):  # two running, one waiting: the queue (1) is full
        wait_for(lambda: running(server) == (2, 1), timeout=30, what="2 running, 1 waiting")
        ask(d, "Hello?")
        wait_for(lambda: last_state(d) == "error", timeout=30, what="the error")
        bubble = d.find_element(By.CSS_SELECTOR, '.msg[data-last="1"] .bubble').text
        assert "HTTP 429" in bubble
        assert "max_queued_requests=1" in bubble  # the server's own message, shown whole
    wait_for(lambda: running(server) == (0, 0), timeout=30, what="the held slots to be freed")
    # The failed turn is not sent again: the next question gets an answer.
    ask(d, "What is the capital of France?")
    wait_for(lambda: last_state(d) == "done", what="an answer after the 429")
    assert "Paris" in messages(d)[-1]["content"]


def test_dashboard_draws_the_traffic(server, browser, shots):
    d = browser
    d.get(server.url + "/dashboard")

    def chart(name: str) -> tuple[int, float]:
        return d.execute_script(
            f"const s = document.querySelector('#chart-{name} svg');"
            "return s ? [Number(s.dataset.points), Number(s.dataset.max)] : [0, 0]"
        )

    # Two requests held open while the page polls: the sampler (1 s) sees both running.
    with holding(server, 2, streaming=2):
        wait_for(lambda: chart("requests")[1] >= 2, timeout=20, what="two running requests drawn")
    for name in ("requests", "throughput", "ttft", "itl", "kv"):
        wait_for(lambda name=name: chart(name)[1] > 0, timeout=15, what=f"chart {name} > 0")
    points, _ = chart("prefix")
    assert points > 0  # the rate is drawn where prompts were looked up (0 is a value)
    tiles = d.find_element(By.ID, "tiles").text
    assert "Requests finished" in tiles
    rows = d.find_elements(By.CSS_SELECTOR, "#per-model tbody tr")
    assert [r.find_elements(By.TAG_NAME, "td")[0].text for r in rows] == [MODEL]
    assert "live" in d.find_element(By.ID, "status").text
    assert js_errors(d) == []
    Select(d.find_element(By.ID, "window")).select_by_value("60")  # the test's traffic, full width
    d.execute_script("document.activeElement.blur()")
    time.sleep(1)
    d.save_screenshot(str(shots / "dashboard.png"))


def test_markdown_escapes_the_models_html(server, browser):
    """What a model writes is text: tags, event handlers and javascript: links stay
    inert; fenced code keeps its characters and gets a copy button."""
    d = browser
    d.get(server.url + "/")
    # the page redraws the thread once the model list is in: inject after that
    wait_for(
        lambda: d.execute_script("return document.querySelectorAll('#model option').length"),
        what="the model list",
    )
    hostile = (
        'Hi <img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>\n\n'
        "[click](javascript:window.pwned=3) [ok](https://example.org/?a=1&b=2)\n\n"
        "```html\n<b>bold?</b>\n```\n\n| a | b |\n|---|---|\n| **x** | `<i>` |"
    )
    html = d.execute_script(
        "const box = document.createElement('div'); box.className = 'bubble'; box.id = 'md-test';"
        "box.innerHTML = Markdown.render(arguments[0]);"
        "document.getElementById('thread').appendChild(box); return box.innerHTML",
        hostile,
    )
    counts = d.execute_script(
        "const b = document.getElementById('md-test');"
        "return [b.querySelectorAll('img, script').length, b.querySelectorAll('a').length,"
        " b.querySelector('a').getAttribute('href'), b.querySelectorAll('pre code').length,"
        " b.querySelector('pre code').textContent, b.querySelectorAll('table td strong').length,"
        " window.pwned === undefined]"
    )
    assert counts == [0, 1, "https://example.org/?a=1&b=2", 1, "<b>bold?</b>", 1, True], html
    assert "&lt;img" in html and "&lt;script&gt;" in html
    button = d.find_element(By.CSS_SELECTOR, "#md-test .copy-code")
    button.click()
    assert button.text == "Copied"
