"""HTTP-level Prometheus metrics (the engine registers its own in the same
default registry; /metrics serves both)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

HTTP_REQUESTS = Counter(
    "markbase_http_requests",
    "HTTP requests answered, by route template, method and status code.",
    ["route", "method", "status"],
)
HTTP_DURATION = Histogram(
    "markbase_http_request_duration_seconds",
    "Wall time from request start to the last byte of the response, by route.",
    ["route"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
HTTP_IN_PROGRESS = Gauge(
    "markbase_http_requests_in_progress",
    "HTTP requests being answered now (streams count until their last byte).",
)
HTTP_CLIENT_DISCONNECTS = Counter(
    "markbase_http_client_disconnects",
    "Requests whose client went away before the response was complete.",
    ["route"],
)

# Connection limits (server.connections) and prompt checks (server.prompt_guard).
CONNECTIONS_OPEN = Gauge(
    "markbase_http_connections_open",
    "TCP connections open now (idle keep-alive connections included).",
)
CONNECTIONS_CLOSED = Counter(
    "markbase_http_connections_closed_by_limit",
    "Connections the server closed because a limit ran out, by reason "
    "(head_timeout, body_timeout, idle_timeout, drain_timeout, chunk_too_large).",
    ["reason"],
)
CONNECTIONS_REJECTED = Counter(
    "markbase_http_connections_rejected",
    "Connections answered 503/429 and closed, by reason: too many open (server_limit, "
    "client_limit), or the client address over its refusal budget (refusals).",
    ["reason"],
)
PROMPTS_REJECTED_UNTOKENIZED = Counter(
    "markbase_prompts_rejected_untokenized",
    "Prompts rejected as over the context window from their length alone, without tokenizing.",
)
LARGE_TOKENIZATIONS = Gauge(
    "markbase_large_tokenizations_in_progress",
    "Long prompts being tokenized now (server.large_prompt_bytes and up).",
)
TOKENIZER_BUSY = Counter(
    "markbase_tokenizer_busy_rejections",
    "Requests answered 429 because as many long prompts as allowed were being tokenized.",
)
