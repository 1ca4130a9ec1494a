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
