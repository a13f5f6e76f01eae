"""The /metrics families under SGLang's names (`sglang:*`), so SGLang's Grafana
dashboard and the tools written against SGLang read a zpd cluster unchanged.

Names, types, label (`model_name`, the served model's name) and histogram buckets are
SGLang's (python/sglang/srt/metrics/collector.py). What each one measures here:

- latencies (`SglangLatencies`), of the requests this front serves, as they pass:
  time to first token, inter-token latency (a chunk of n tokens counts n gaps of an
  equal share, as SGLang does), end-to-end latency, queue time (the prefill's), and
  SGLang's older time per output token ((last - first token) / (tokens - 1), per
  finished request of two tokens or more);
- the cluster as one SGLang server would report it (`SglangCluster`), read from the
  router's `status` at each scrape: requests running (in a decode batch) and queued
  (waiting for the router, a prefill or decode pages), the disaggregation queues, KV
  token usage over every worker's pool, the tokens clients got per second over the
  router's last 10 s, the prefills' prefix-cache hit rate over their last minute, and
  the router's totals (prompt, generation and cached tokens, requests, aborts).

A family the router's reply cannot fill (it did not answer) is left out, not shown
as 0: a counter that drops to 0 and back would read as a reset and a burst.
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

LABELS = ["model_name"]

TTFT_BUCKETS = (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
E2E_BUCKETS = TTFT_BUCKETS + (600, 1200, 1800, 2400)
ITL_BUCKETS = (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
               0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
QUEUE_BUCKETS = (0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90,
                 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800,
                 2000, 2500, 3000)


class TokenHistogram(Histogram):
    """A Histogram observed once per streamed token (the inter-token latencies): an
    observation adds to a list here, in the caller's thread (the front's event loop,
    the one thread that observes and collects them), and the histogram's own values
    take the sums when it is collected. prometheus_client's `observe` (a lock per
    value) cost 0.7 us, two per token."""

    def _metric_init(self) -> None:
        super()._metric_init()
        self._pending = [0] * len(self._upper_bounds)
        self._pending_sum = 0.0

    def observe(self, amount: float, exemplar: dict | None = None) -> None:
        self._pending[bisect_left(self._upper_bounds, amount)] += 1
        self._pending_sum += amount

    def observe_many(self, amount: float, times: int) -> None:
        """`observe(amount)` `times` times."""
        self._pending[bisect_left(self._upper_bounds, amount)] += times
        self._pending_sum += amount * times

    def _child_samples(self) -> Iterable:
        pending, self._pending = self._pending, [0] * len(self._upper_bounds)
        total, self._pending_sum = self._pending_sum, 0.0
        for value, n in zip(self._buckets, pending):
            if n:
                value.inc(n)
        if total:
            self._sum.inc(total)
        return super()._child_samples()


class SglangLatencies:
    """SGLang's request-latency histograms, in the front's registry."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        def histogram(name: str, doc: str, buckets: tuple, kind: type = Histogram) -> Histogram:
            h = kind(name, doc, LABELS, buckets=buckets, registry=registry)
            return h.labels(model)      # one model per front: bind its label once

        self.ttft = histogram("sglang:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS,
                             TokenHistogram)
        self.tpot = histogram("sglang:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (SGLang's "
                              "older name; per finished request).", ITL_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds",
                             "Histogram of End-to-end request latency in seconds",
                             E2E_BUCKETS)
        self.queue = histogram("sglang:queue_time_seconds",
                               "Histogram of queueing time in seconds.", QUEUE_BUCKETS)

    def finished(self, e2e: float, decode_s: float | None, tokens: int,
                 queued_s: float | None) -> None:
        """A request ended: `decode_s` from its first token to its last, `tokens`
        received in all, `queued_s` in its prefill's queue (None: not known)."""
        self.e2e.observe(e2e)
        if decode_s is not None and tokens >= 2:
            self.tpot.observe(decode_s / (tokens - 1))
        if queued_s is not None:
            self.queue.observe(queued_s)


class SglangCluster:
    """One scrape's worth of SGLang's server gauges and counters, from a router
    `status` reply (`{"workers": [...], "counters": {...}, "queued": n, ...}`)."""

    def __init__(self, status: dict, model: str) -> None:
        self.status, self.model = status, model

    def collect(self) -> Iterator[Metric]:
        s = self.status
        listed = s.get("workers") if isinstance(s.get("workers"), list) else []
        workers = [w for w in listed if isinstance(w, dict) and w.get("ok")]
        if workers or s.get("ok"):
            yield from self._requests(s, workers)
            yield from self._tokens(workers)
        counters = s.get("counters")
        if isinstance(counters, dict):
            yield from self._totals(counters, workers)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=LABELS)
        family.add_metric([self.model], float(value))
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric([self.model], float(value))
        return family

    def _requests(self, s: dict, workers: list[dict]) -> Iterator[Metric]:
        def queue(role: str, *names: str) -> int:
            return sum(number(_dict(w.get("queues")).get(n)) for w in workers
                       if w.get("role") == role for n in names)

        yield self._gauge("sglang:num_running_reqs", "The number of running requests (in a "
                          "decode batch).", queue("decode", "running"))
        yield self._gauge("sglang:num_queue_reqs", "The number of requests in the waiting "
                          "queue (the router's while paused, the prefills', and those waiting "
                          "for decode pages).", number(s.get("queued")) + queue("prefill", "waiting")
                          + queue("decode", "waiting_pages"))
        yield self._gauge("sglang:num_prefill_inflight_queue_reqs", "The number of requests "
                          "in the prefill inflight queue (computed, KV not yet written).",
                          queue("prefill", "waiting_kv_dest", "writing"))
        yield self._gauge("sglang:num_decode_prealloc_queue_reqs", "The number of requests in "
                          "the decode prealloc queue.", queue("decode", "waiting_pages"))
        yield self._gauge("sglang:num_decode_transfer_queue_reqs", "The number of requests in "
                          "the decode transfer queue.", queue("decode", "waiting_kv"))

    def _tokens(self, workers: list[dict]) -> Iterator[Metric]:
        total = used = 0
        for w in workers:
            pages, size = _dict(w.get("kv_pages")), number(w.get("page_size"))
            total += number(pages.get("total")) * size
            # what requests hold, in flight or fenced: free and idle cached pages are room
            used += (number(pages.get("total")) - number(pages.get("free"))
                     - number(pages.get("cached"))) * size
        hits = asked = 0
        for w in workers:
            if w.get("role") == "prefill":
                cache = _dict(w.get("prefix_cache"))
                hits += number(cache.get("recent_hit_tokens"))
                asked += number(cache.get("recent_query_tokens"))
        yield self._gauge("sglang:max_total_num_tokens", "Maximum total number of tokens in "
                          "the KV cache pool (every worker's).", total)
        yield self._gauge("sglang:num_used_tokens", "The number of used tokens.", max(used, 0))
        yield self._gauge("sglang:token_usage", "The token usage.",
                          max(used, 0) / total if total else 0.0)
        yield self._gauge("sglang:cache_hit_rate", "The prefix cache hit rate (the prefills', "
                          "over their last minute).", hits / asked if asked else 0.0)

    def _totals(self, c: dict, workers: list[dict]) -> Iterator[Metric]:
        finished = c.get("finished") if isinstance(c.get("finished"), dict) else {}
        yield self._gauge("sglang:gen_throughput", "The generation throughput (token/s), over "
                          "the router's last 10 s.", number(c.get("gen_throughput")))
        yield self._counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.",
                            number(c.get("prompt_tokens")))
        yield self._counter("sglang:generation_tokens_total", "Number of generation tokens "
                            "processed.", number(c.get("generation_tokens")))
        yield self._counter("sglang:cached_tokens_total", "Number of cached prompt tokens.",
                            number(c.get("cached_tokens")))
        yield self._counter("sglang:num_requests_total", "Number of requests processed.",
                            sum(number(n) for n in finished.values()))
        yield self._counter("sglang:num_aborted_requests_total", "Number of requests aborted.",
                            number(finished.get("abort")))
        failed = sum(number(_dict(w.get("counters")).get("kv_transfer_failures"))
                     for w in workers if w.get("role") == "prefill")
        yield self._counter("sglang:num_transfer_failed_reqs_total", "The number of transfer "
                            "failed requests.", failed)
        yield from self._realtime(c, workers)

    def _realtime(self, c: dict, workers: list[dict]) -> Iterator[Metric]:
        """SGLang's tokens by mode: prompt tokens computed and taken from the cache by
        the prefills, and tokens generated."""
        def prefills(key: str) -> float:
            return sum(number(_dict(w.get("counters")).get(key)) for w in workers
                       if w.get("role") == "prefill")

        family = CounterMetricFamily("sglang:realtime_tokens_total", "Total number of tokens "
                                     "processed. mode: prefill_compute, prefill_cache, decode.",
                                     labels=LABELS + ["mode"])
        for mode, value in (("prefill_compute", prefills("prompt_tokens_computed")),
                            ("prefill_cache", prefills("prefix_cache_hit_tokens")),
                            ("decode", number(c.get("generation_tokens")))):
            family.add_metric([self.model, mode], float(value))
        yield family


def _dict(value: object) -> dict:
    return value if isinstance(value, dict) else {}


def number(value: object) -> float:
    """A count or amount from a status reply; anything else (a worker is a peer, its
    reply untrusted) counts 0."""
    return value if type(value) in (int, float) and value == value and value >= 0 else 0
