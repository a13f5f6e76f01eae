"""`zpd http --workers N`: a scrape of any front sums every front's latency histograms
(zpd/http/shared_metrics.py), its own live and the others' last snapshots."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from zpd.http.metrics import RequestMetrics
from zpd.http.shared_metrics import SharedHistograms


def samples(text: bytes) -> dict[tuple, float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text.decode()) for s in f.samples}


def test_a_scrape_sums_every_fronts_histograms_and_keeps_a_dead_fronts_counts(tmp_path):
    fronts = [RequestMetrics("m") for _ in range(3)]
    shared = [SharedHistograms(tmp_path, m.registry, name=f"front{i}")
              for i, m in enumerate(fronts)]
    for i, m in enumerate(fronts):
        for _ in range(i + 1):
            m.e2e.observe(0.05)
            m.sglang.ttft.observe(0.3)
    shared[1].write()
    shared[2].write()
    (tmp_path / "front2.prom").rename(tmp_path / "dead.prom")     # a front that died
    fronts[0].e2e.observe(0.05)                  # the scraped front: its live values count
    got = samples(shared[0].render())
    assert got[("zpd:e2e_request_latency_seconds_count", ())] == 2 + 2 + 3
    assert got[("zpd:e2e_request_latency_seconds_bucket", (("le", "0.06"),))] == 7
    assert got[("sglang:time_to_first_token_seconds_count", (("model_name", "m"),))] == 6
    assert not any(name.endswith("_created") for name, _ in got)


def test_a_file_cut_short_is_skipped_not_fatal(tmp_path):
    m = RequestMetrics("m")
    m.e2e.observe(1.0)
    (tmp_path / "other.prom").write_text('zpd:e2e_request_latency_seconds_count{le="')
    got = samples(SharedHistograms(tmp_path, m.registry, name="me").render())
    assert got[("zpd:e2e_request_latency_seconds_count", ())] == 1
