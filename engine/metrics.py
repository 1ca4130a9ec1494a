"""Prometheus metrics of the engine, labelled by model.

Registered once in the default registry; ``/metrics`` serves them with the HTTP
layer's own. Names follow vLLM's where a user would look for the same thing.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from prometheus_client import Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_ITL_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2)

requests_running = Gauge(
    "markbase_num_requests_running", "Sequences in the running batch or prefilling", ["model"]
)
requests_waiting = Gauge("markbase_num_requests_waiting", "Requests waiting for a slot", ["model"])
kv_usage = Gauge(
    "markbase_kv_cache_usage_ratio",
    "KV tokens reserved by running sequences / max_kv_tokens",
    ["model"],
)
kv_bytes = Gauge("markbase_kv_cache_bytes", "Bytes held by the running batch's KV cache", ["model"])
prefix_cache_tokens = Gauge(
    "markbase_prefix_cache_tokens", "Tokens held by the prefix cache", ["model"]
)
prefix_cache_bytes = Gauge(
    "markbase_prefix_cache_bytes", "Bytes of KV arrays held by the prefix cache", ["model"]
)
mlx_memory = Gauge(
    "markbase_mlx_memory_bytes",
    "MLX's allocator, whole process: arrays alive (active) and freed buffers kept for reuse (cache)",
    ["kind"],
)
prompt_tokens = Counter(
    "markbase_prompt_tokens", "Prompt tokens processed (cached ones included)", ["model"]
)
generation_tokens = Counter("markbase_generation_tokens", "Tokens generated", ["model"])
prefix_cache_queries = Counter(
    "markbase_prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ["model"]
)
prefix_cache_hits = Counter(
    "markbase_prefix_cache_hits", "Prompt tokens served from the prefix cache", ["model"]
)
requests_finished = Counter(
    "markbase_requests_finished", "Finished requests by reason", ["model", "finish_reason"]
)
time_to_first_token = Histogram(
    "markbase_time_to_first_token_seconds",
    "Arrival to first token",
    ["model"],
    buckets=_LATENCY_BUCKETS,
)
inter_token_latency = Histogram(
    "markbase_inter_token_latency_seconds",
    "Time between tokens of a sequence",
    ["model"],
    buckets=_ITL_BUCKETS,
)
request_latency = Histogram(
    "markbase_e2e_request_latency_seconds",
    "Arrival to last token",
    ["model"],
    buckets=_LATENCY_BUCKETS,
)
step_batch_size = Histogram(
    "markbase_decode_batch_size",
    "Rows per decode step",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)
prefill_group_size = Histogram(
    "markbase_prefill_group_size",
    "Prompts finished by one prefill forward (1: alone)",
    ["model"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128),
)


class ModelMetrics:
    """The children of every metric above for one model, bound once: ``labels()``
    takes a lock and a dict lookup, too much to pay per token in the hot loop."""

    def __init__(self, model: str) -> None:
        self.model = model
        for name, metric in _PER_MODEL.items():
            setattr(self, name, metric.labels(model))

    def finished(self, reason: str) -> None:
        requests_finished.labels(self.model, reason).inc()


_PER_MODEL = {
    name: obj
    for name, obj in dict(globals()).items()
    if isinstance(obj, (Counter, Gauge, Histogram)) and obj._labelnames == ("model",)
}


def observe_many(histogram, values: list[float]) -> None:
    """``histogram.observe(v)`` for every ``v`` in ``values`` (one histogram child), with
    one update of the sum and one per bucket hit instead of two locked updates and a
    bucket scan per value. The worker calls it once per decode step with every row's
    inter-token gap: rows whose previous token came in the same step have the same gap,
    so a step touches one bucket or a few. A value counts in the first bucket whose
    bound is >= it, as in ``observe``. Reads prometheus_client's ``Histogram``
    internals (``_upper_bounds``, ``_buckets``, ``_sum``); without them, and for
    fewer than three values, it calls ``observe``."""
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:
        bounds = None
    if bounds is None or len(values) < 3:
        for v in values:
            histogram.observe(v)
        return
    total.inc(sum(values))
    first = values[0]
    if values.count(first) == len(values):  # the usual step: every row's gap the same
        buckets[bisect_left(bounds, first)].inc(len(values))
        return
    ordered = sorted(values)
    done = 0  # values counted so far: those <= the previous bound
    for i, bound in enumerate(bounds):  # the last bound is +Inf
        upto = bisect_right(ordered, bound)
        if upto > done:
            buckets[i].inc(upto - done)
            done = upto
            if done == len(ordered):
                break
