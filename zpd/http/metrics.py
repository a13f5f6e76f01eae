"""GET /metrics: Prometheus text, names `zpd:*` in the style of `vllm:*` / `sglang:*`,
and the same figures again under SGLang's own names (zpd/http/sglang_metrics.py).
The `zpd:*` duplicates of SGLang-named figures stay, for the users who read them.

Two sources. Latencies are measured here, per request this front serves, by wrapping
the router client (`MeteredBackend`): time to first token, inter-token latency,
end-to-end latency, and queue time (the prefill's, from the request's timings); with
`zpd http --workers N`, summed over every front (zpd/http/shared_metrics.py).
Everything else is the cluster's, read from the router's `status` at each scrape
(`ClusterCollector`): requests running and waiting, KV pages per worker, and the
counters the router and workers keep (tokens every client received, requests ended
by reason and status code, retractions, KV bytes written, transfer time and failures).
"""
from __future__ import annotations

import time
from typing import Callable, Iterator

from aiohttp import web
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from zpd.http.front import FRONT
from zpd.http.records import GenRequest
from zpd.http.sglang_metrics import SglangCluster, SglangLatencies, TokenHistogram, number
from zpd.http.shared_metrics import SharedHistograms
from zpd.http.streams import Backend

routes = web.RouteTableDef()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
                   0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class RequestMetrics:
    """The latency histograms of the requests this front serves (of the served model
    `model`, SGLang's `model_name` label); `shared_dir`: where the fronts of `zpd http
    --workers N` sum theirs."""

    def __init__(self, model: str = "", shared_dir: str | None = None) -> None:
        self.registry = CollectorRegistry()
        self.model = model
        self.shared = SharedHistograms(shared_dir, self.registry) if shared_dir else None
        self.sglang = SglangLatencies(self.registry, model)

        def histogram(name: str, doc: str, kind: type = Histogram) -> Histogram:
            return kind(name, doc, buckets=LATENCY_BUCKETS, registry=self.registry)

        self.ttft = histogram("zpd:time_to_first_token_seconds",
                              "Time from the request's arrival here to its first token.")
        self.itl = histogram("zpd:inter_token_latency_seconds",
                             "Time between two output tokens of a streamed request (a "
                             "non-streamed one arrives whole: only its TTFT and end count).",
                             TokenHistogram)
        self.e2e = histogram("zpd:e2e_request_latency_seconds",
                             "Time from the request's arrival here to its last chunk.")
        self.queue = histogram("zpd:request_queue_time_seconds",
                               "Time the request waited in its prefill's queue.")


class MeteredBackend:
    """The router client, timing every request's chunks as they pass."""

    def __init__(self, inner: Backend, metrics: RequestMetrics) -> None:
        self.inner, self.metrics = inner, metrics

    def open(self, req: GenRequest, sink: Callable[[dict], None]) -> Callable[[], None]:
        m, start = self.metrics, time.perf_counter()
        clock, gaps, sglang_gaps = time.perf_counter, m.itl.observe_many, m.sglang.itl.observe_many
        first = last = None
        tokens = 0

        def timed(chunk: dict) -> None:
            nonlocal first, last, tokens
            n = len(chunk["token_ids"])
            if n:
                now = clock()
                if last is None:
                    first = now
                    m.ttft.observe(now - start)
                    m.sglang.ttft.observe(now - start)
                else:       # a chunk of n tokens: n gaps of an equal share
                    gaps((now - last) / n, n)
                    sglang_gaps((now - last) / n, n)
                last, tokens = now, tokens + n
            if chunk["finished"]:
                self._finished(chunk, start, first, tokens)
            sink(chunk)
        return self.inner.open(req, timed)

    def _finished(self, chunk: dict, start: float, first: float | None, tokens: int) -> None:
        m, now = self.metrics, time.perf_counter()
        m.e2e.observe(now - start)
        queued = chunk.get("meta", {}).get("timings", {}).get("prefill_queue")
        queued = queued / 1e3 if type(queued) in (int, float) and queued >= 0 else None
        if queued is not None:
            m.queue.observe(queued)
        m.sglang.finished(now - start, None if first is None else now - first, tokens, queued)

    async def admin(self, command: str, timeout: float | None = None, **args) -> dict:
        return await self.inner.admin(command, timeout, **args)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)        # start, close, ... of the router client


class ClusterCollector:
    """One scrape's worth of the cluster's state, from a router `status` reply."""

    def __init__(self, status: dict) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status
        up = GaugeMetricFamily("zpd:router_up", "1 when the router answered this scrape.")
        up.add_metric([], 1.0 if s.get("ok") or s.get("workers") else 0.0)
        yield up
        yield from self._requests(s)
        workers = s.get("workers") if isinstance(s.get("workers"), list) else []
        yield from self._workers([w for w in workers if isinstance(w, dict)])
        yield from self._counters(s.get("counters") if isinstance(s.get("counters"), dict) else {})

    def _requests(self, s: dict) -> Iterator[Metric]:
        running = GaugeMetricFamily("zpd:num_requests_running",
                                    "Requests the router has routed and not seen end.")
        running.add_metric([], number(s.get("inflight")))
        waiting = GaugeMetricFamily("zpd:num_requests_waiting",
                                    "Requests queued at the router (while paused).")
        waiting.add_metric([], number(s.get("queued")))
        yield running
        yield waiting

    def _workers(self, workers: list[dict]) -> Iterator[Metric]:
        labels = ["worker", "role"]
        pages = GaugeMetricFamily("zpd:kv_pages", "KV pages per worker and state.",
                                  labels=labels + ["state"])
        queues = GaugeMetricFamily("zpd:worker_requests", "Requests per worker and queue.",
                                   labels=labels + ["queue"])
        alive = GaugeMetricFamily("zpd:worker_up", "1 when the worker answered status.",
                                  labels=labels)
        counters = {key: CounterMetricFamily(f"zpd:{name}", doc, labels=labels) for key, name, doc in (
            ("prompt_tokens_computed", "prefill_tokens_computed", "Prompt tokens a prefill computed."),
            ("prefill_forward_seconds", "prefill_forward_time_seconds",
             "Time a prefill spent in forward passes."),
            ("prefix_cache_hit_tokens", "prefix_cache_hit_tokens",
             "Prompt tokens a prefill took from its prefix cache."),
            ("prefix_cache_query_tokens", "prefix_cache_query_tokens",
             "Prompt tokens a prefill looked up in its prefix cache."),
            ("kv_bytes_written", "kv_transfer_bytes", "KV bytes a prefill wrote to decodes."),
            ("kv_transfer_seconds", "kv_transfer_time_seconds", "Time a prefill's KV writes took."),
            ("kv_transfer_failures", "kv_transfer_failures", "KV writes that failed."))}
        for w in workers:
            who = [str(w.get("endpoint")), str(w.get("role"))]
            alive.add_metric(who, 1.0 if w.get("ok") else 0.0)
            for state, n in _items(w.get("kv_pages")):
                pages.add_metric(who + [str(state)], number(n))
            for queue, n in _items(w.get("queues")):
                queues.add_metric(who + [str(queue)], number(n))
            for key, value in _items(w.get("counters")):
                if key in counters:
                    counters[key].add_metric(who, number(value))
        yield from (alive, pages, queues, *counters.values())

    def _counters(self, c: dict) -> Iterator[Metric]:
        for key, name, doc in (("generation_tokens", "generation_tokens",
                                "Output tokens clients received (first tokens included)."),
                               ("prompt_tokens", "prompt_tokens", "Prompt tokens of ended requests."),
                               ("retractions", "retractions", "Retractions of ended requests.")):
            family = CounterMetricFamily(f"zpd:{name}", doc)
            family.add_metric([], number(c.get(key)))
            yield family
        ended = CounterMetricFamily("zpd:request_finished", "Requests ended, by finish reason.",
                                    labels=["finished_reason"])
        for reason, n in _items(c.get("finished")):
            ended.add_metric([str(reason)], number(n))
        aborted = CounterMetricFamily("zpd:request_aborted", "Requests ended in an abort or "
                                      "failure, by status code.", labels=["status_code"])
        for code, n in _items(c.get("aborted")):
            aborted.add_metric([str(code)], number(n))
        yield ended
        yield aborted


def _items(value: object) -> list:
    """A status reply's dict as (key, value) pairs; anything else (workers are peers,
    their replies untrusted) as none."""
    return list(value.items()) if isinstance(value, dict) else []


async def render(metrics: RequestMetrics, backend: Backend, timeout: float = 5.0) -> bytes:
    """The whole /metrics page: our histograms, then the cluster as the router sees it."""
    status = await backend.admin("status", timeout=timeout)
    cluster = CollectorRegistry()
    cluster.register(ClusterCollector(status))
    cluster.register(SglangCluster(status, metrics.model))
    ours = metrics.shared.render() if metrics.shared else generate_latest(metrics.registry)
    return ours + generate_latest(cluster)


def metered(backend: Backend, model: str = "", shared_dir: str | None = None) -> MeteredBackend:
    """`backend` with a fresh set of histograms for the served model `model` (itself if
    it already has them); `shared_dir`: see RequestMetrics."""
    return backend if isinstance(backend, MeteredBackend) else \
        MeteredBackend(backend, RequestMetrics(model, shared_dir))


@routes.get("/metrics")
async def metrics_page(request: web.Request) -> web.Response:
    backend = request.app[FRONT].backend
    body = await render(backend.metrics, backend)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})
