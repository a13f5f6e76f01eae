"""/metrics under SGLang's names (zpd/http/sglang_metrics.py), scraped through the HTTP
front on a fake router (tests/unit/http_fake.py) and parsed with prometheus_client's
own parser: every name SGLang's Grafana dashboard queries is there with `model_name`;
the latency histograms count each request the front serves; the cluster's figures are
what a router `status` says, one made by hand and one from the real router and workers
of the in-process cluster (tests/unit/inproc.py) after requests sharing a prefix."""
from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from tests.unit.http_fake import FakeBackend, call, chunk, front
from tests.unit.inproc import InprocCluster
from zpd.wire.recent import Recent

# The sample names the panels of SGLang's dashboard query
# (examples/monitoring/grafana/dashboards/json/sglang-dashboard.json); the heatmaps
# filter the histograms' buckets on model_name.
DASHBOARD = [f"sglang:{h}_seconds_{part}" for h in ("e2e_request_latency", "time_to_first_token")
             for part in ("bucket", "sum", "count")] + [
    "sglang:num_running_reqs", "sglang:gen_throughput", "sglang:cache_hit_rate",
    "sglang:num_queue_reqs"]

SERVED = ["sglang:inter_token_latency_seconds_count", "sglang:time_per_output_token_seconds_count",
          "sglang:queue_time_seconds_count", "sglang:token_usage", "sglang:num_used_tokens",
          "sglang:max_total_num_tokens", "sglang:prompt_tokens_total",
          "sglang:generation_tokens_total", "sglang:cached_tokens_total",
          "sglang:num_requests_total", "sglang:num_aborted_requests_total",
          "sglang:num_transfer_failed_reqs_total", "sglang:realtime_tokens_total",
          "sglang:num_prefill_inflight_queue_reqs", "sglang:num_decode_prealloc_queue_reqs",
          "sglang:num_decode_transfer_queue_reqs"]


def worker(role: str, endpoint: str, total: int, free: int, cached: int = 0, **extra) -> dict:
    return {"ok": True, "role": role, "endpoint": endpoint, "page_size": 16,
            "kv_pages": {"total": total, "free": free, "held": total - free - cached,
                         "fenced": 0, "cached": cached}} | extra


STATUS = {"ok": True, "queued": 2, "inflight": 9, "workers": [
    worker("prefill", "p:1", 100, 80, 10, queues={"waiting": 3, "waiting_kv_dest": 1, "writing": 2},
           prefix_cache={"recent_hit_tokens": 96, "recent_query_tokens": 128},
           counters={"prompt_tokens_computed": 500, "prefix_cache_hit_tokens": 300,
                     "kv_transfer_failures": 1}),
    worker("decode", "d:1", 200, 150, queues={"running": 4, "waiting_pages": 1, "waiting_kv": 2}),
    worker("decode", "d:2", 200, 200, queues={"running": 1, "waiting_pages": 0, "waiting_kv": 0}),
    {"ok": False, "role": "decode", "endpoint": "d:3", "status": 503}],
    "counters": {"generation_tokens": 1234, "prompt_tokens": 800, "cached_tokens": 300,
                 "retractions": 0, "finished": {"stop": 5, "length": 3, "abort": 2},
                 "aborted": {"499": 2}, "gen_throughput": 42.5}}


def scrape(f) -> dict[str, list]:
    """Sample name -> its samples, from GET /metrics."""
    status, text = call(f, "GET", "/metrics", read="text")
    assert status == 200
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def value(got: dict, name: str, **labels) -> float:
    return sum(s.value for s in got.get(name, []) if labels.items() <= s.labels.items())


def test_every_name_the_dashboard_queries_is_served_with_model_name():
    got = scrape(front(FakeBackend(replies={"status": STATUS})))
    for name in DASHBOARD + SERVED:
        assert got.get(name), f"{name} is not served"
        assert all(s.labels.get("model_name") == "tiny" for s in got[name]), (name, got[name])


def test_the_cluster_figures_are_the_status_replys():
    got = scrape(front(FakeBackend(replies={"status": STATUS})))
    assert value(got, "sglang:num_running_reqs") == 5                  # decode batches
    assert value(got, "sglang:num_queue_reqs") == 2 + 3 + 1           # router, prefill, pages
    assert value(got, "sglang:num_prefill_inflight_queue_reqs") == 3
    assert value(got, "sglang:num_decode_transfer_queue_reqs") == 2
    assert value(got, "sglang:max_total_num_tokens") == 500 * 16
    assert value(got, "sglang:num_used_tokens") == (10 + 50) * 16     # idle cached pages are room
    assert math.isclose(value(got, "sglang:token_usage"), 60 / 500)
    assert value(got, "sglang:cache_hit_rate") == 96 / 128
    assert value(got, "sglang:gen_throughput") == 42.5
    assert value(got, "sglang:generation_tokens_total") == 1234
    assert value(got, "sglang:prompt_tokens_total") == 800
    assert value(got, "sglang:cached_tokens_total") == 300
    assert value(got, "sglang:num_requests_total") == 10
    assert value(got, "sglang:num_aborted_requests_total") == 2
    assert value(got, "sglang:num_transfer_failed_reqs_total") == 1
    assert value(got, "sglang:realtime_tokens_total", mode="prefill_cache") == 300
    assert value(got, "sglang:realtime_tokens_total", mode="prefill_compute") == 500
    assert value(got, "zpd:generation_tokens_total") == 1234          # zpd's names stay


def test_a_silent_router_leaves_the_cluster_families_out_and_garbage_counts_0():
    got = scrape(front(FakeBackend(replies={"status": {"ok": False, "status": 504}})))
    assert "sglang:generation_tokens_total" not in got and "sglang:num_running_reqs" not in got
    assert got["sglang:time_to_first_token_seconds_count"]            # the front's own stay
    bad = {"ok": True, "queued": "9", "workers": [
        worker("decode", "d:1", 10, 4, queues={"running": -3, "waiting_pages": [1]},
               page_size=float("nan")),
        "not a worker", {"ok": True, "role": "prefill", "queues": [3], "kv_pages": "all",
                         "prefix_cache": {"recent_hit_tokens": True}}],
        "counters": {"generation_tokens": "many", "finished": ["x"], "gen_throughput": -1}}
    got = scrape(front(FakeBackend(replies={"status": bad})))
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
                 "sglang:cache_hit_rate", "sglang:generation_tokens_total",
                 "sglang:num_requests_total", "sglang:gen_throughput"):
        assert value(got, name) == 0, name


def timed_answer(req, rid):
    """Three tokens, one per chunk, the prefill's queue time 250 ms in the final meta."""
    meta = {"prompt_tokens": 3, "completion_tokens": 3, "retractions": 0, "cached_tokens": 0,
            "timings": {"prefill_queue": 250.0}}
    return [chunk(rid, [72]), chunk(rid, [105]), chunk(rid, [33], {"type": "length"}, meta, "Hi!")]


def test_latency_histograms_count_each_request_the_front_serves():
    f = front(FakeBackend(timed_answer, replies={"status": STATUS}))
    before = scrape(f)
    body = {"input_ids": [[3, 4, 5], [6, 7, 8]], "sampling_params": {"max_new_tokens": 3}}
    assert call(f, "POST", "/generate", body)[0] == 200
    after = scrape(f)

    def moved(name: str) -> float:
        return value(after, name, model_name="tiny") - value(before, name, model_name="tiny")

    assert moved("sglang:time_to_first_token_seconds_count") == 2
    assert moved("sglang:e2e_request_latency_seconds_count") == 2
    assert moved("sglang:inter_token_latency_seconds_count") == 4      # two gaps each
    assert moved("sglang:time_per_output_token_seconds_count") == 2
    assert moved("sglang:queue_time_seconds_count") == 2
    assert math.isclose(moved("sglang:queue_time_seconds_sum"), 0.5)
    assert moved("sglang:e2e_request_latency_seconds_sum") >= \
        moved("sglang:time_to_first_token_seconds_sum") > 0
    top = [s for s in after["sglang:time_to_first_token_seconds_bucket"] if s.labels["le"] == "+Inf"]
    assert top[0].value == value(after, "sglang:time_to_first_token_seconds_count")
    assert {s.labels["le"] for s in after["sglang:e2e_request_latency_seconds_bucket"]} >= {
        "0.1", "2400.0", "+Inf"}                                      # SGLang's buckets


def test_a_real_clusters_status_reads_as_what_was_served():
    """Two prompts sharing three pages: the second's prefill takes 48 tokens from its
    cache; the scrape says so (cached tokens, hit rate) and counts tokens and requests."""
    system = [(7 * i + 3) % 250 for i in range(48)]
    c = InprocCluster(kv_cache_mb=2.0)
    try:
        first = c.run(c.submit(system + [1, 2], 5))
        second = c.run(c.submit(system + [3, 4], 5))
        status = c.admin("status")
        pages = sum(w["kv_pages"]["total"] for w in status["workers"])
    finally:
        c.close()
    assert (first.meta["cached_tokens"], second.meta["cached_tokens"]) == (0, 48)
    got = scrape(front(FakeBackend(replies={"status": status})))
    assert value(got, "sglang:cached_tokens_total") == 48
    assert value(got, "sglang:prompt_tokens_total") == 100
    assert value(got, "sglang:generation_tokens_total") == 10
    assert value(got, "sglang:num_requests_total") == 2
    assert value(got, "sglang:num_aborted_requests_total") == 0
    assert value(got, "sglang:cache_hit_rate") == 48 / 100
    assert value(got, "sglang:max_total_num_tokens") == pages * 16
    assert value(got, "sglang:num_used_tokens") == 0 and value(got, "sglang:num_running_reqs") == 0
    assert value(got, "sglang:gen_throughput") > 0


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recent_totals_cover_only_the_span():
    clock = FakeClock()
    r = Recent(10, width=2, clock=clock)
    r.add(5, 8)
    clock.now += 0.5
    assert r.per_second() == 5 / 1.0               # at least a second, however early
    clock.now += 4.5
    r.add(3, 4)
    assert r.totals() == [8, 12] and r.per_second() == 8 / 5
    clock.now += 6                                  # the first second is out of the span now
    assert r.totals() == [3, 4]
    assert math.isclose(r.per_second(), 3 / (clock.now - (int(clock.now) - 9)))
    clock.now += 60
    assert r.totals() == [0, 0] and r.per_second() == 0
    for _ in range(1000):                           # one bucket a second, whatever the traffic
        r.add(1, 1)
    assert len(r._buckets) == 1
