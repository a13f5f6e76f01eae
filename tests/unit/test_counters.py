"""The totals `status` reports for /metrics: the router's count of what clients got
(tokens, ends by reason and status code) and the prefill's compute and transfer totals
move by exactly what was served (tests/unit/inproc.py)."""
from __future__ import annotations

from tests.unit.inproc import send_raw
from zpd.router.tally import THROUGHPUT_SPAN_S
from zpd.wire.protocol import Generate

GREEDY = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}


def test_status_counts_what_was_served(cluster):
    before = cluster.admin("status")
    assert before["counters"] == {"generation_tokens": 0, "prompt_tokens": 0, "retractions": 0,
                                  "cached_tokens": 0, "finished": {}, "aborted": {},
                                  "gen_throughput": 0.0}
    for prompt in ([1, 2, 3], [4, 5, 6, 7]):
        cluster.run(cluster.submit(prompt, max_new=5))
    send_raw(cluster.client, Generate("bad", [], stream=True, text="x"), GREEDY | {"top_k": -5})
    assert cluster.run("bad").status == 400
    after = cluster.admin("status")
    c = after["counters"]
    assert c["generation_tokens"] == 10 and c["prompt_tokens"] == 7 and c["cached_tokens"] == 0
    # the 10 tokens fell within the last THROUGHPUT_SPAN_S seconds, which the rate spans
    # at most (at least one second, however fast the test)
    assert 10 / THROUGHPUT_SPAN_S <= c["gen_throughput"] <= 10
    assert c["finished"] == {"length": 2, "abort": 1} and c["aborted"] == {"400": 1}
    prefill = next(w for w in after["workers"] if w["role"] == "prefill")
    assert prefill["counters"]["prompt_tokens_computed"] == 7
    assert prefill["counters"]["kv_bytes_written"] > 0
    assert prefill["counters"]["kv_transfer_failures"] == 0


def test_status_names_each_workers_device(cluster):
    workers = cluster.admin("status")["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill"]
    assert all(w["device"] == "cpu" for w in workers)
