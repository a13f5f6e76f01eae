"""Resource limits (issue #11, finding 7): caps on a request's prompt and stop
conditions, each client's share of the router, and --max-batch as a true bound on
the decode. Cluster scenarios run in one process (tests/unit/inproc.py)."""
from __future__ import annotations

import pytest

from engines.sampler import MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from tests.unit.inproc import InprocCluster, reference
from zpd.wire.protocol import Generate
from zpd.worker.decode import DecodePhase

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}


@pytest.fixture
def cluster():
    c = InprocCluster()
    yield c
    c.close()


# --- stop conditions ------------------------------------------------------------------


@pytest.mark.parametrize("bad, name", [
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["x" * (MAX_STOP_LENGTH + 1)]}, "stop"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids")])
def test_stop_conditions_are_capped(bad, name):
    with pytest.raises(ValueError, match=f"^{name}: at most"):
        SamplingParams.from_dict(bad)


def test_stop_conditions_at_their_caps_are_accepted():
    p = SamplingParams.from_dict({"stop": ["x" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS,
                                  "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))})
    assert len(p.stop) == MAX_STOP_STRINGS and len(p.stop_token_ids) == MAX_STOP_TOKEN_IDS


def test_too_many_stops_get_400_from_the_workers(cluster):
    rid = "stops"
    cluster.client.send(Generate(rid, PROMPT, GREEDY | {"stop": ["s"] * 100_000}))
    got = cluster.run(rid)
    assert got.status == 400 and "stop: at most" in got.finish["message"]
    cluster.pump()
    cluster.check_pages()


# --- --max-batch bounds the decode ----------------------------------------------------


def test_max_batch_counts_requests_still_transferring():
    c = InprocCluster(max_batch=2)
    try:
        rids = [c.submit(PROMPT[i:], 6) for i in range(6)]
        worst = 0
        for _ in range(600):
            c.pump(1)
            phases = [j.phase for j in c.decode.scheduler.jobs.values()]
            worst = max(worst, len(c.decode.scheduler.batch) + phases.count(DecodePhase.TRANSFERRING))
            if all(c.finished(r) for r in rids):
                break
        assert worst == 2
        for i, rid in enumerate(rids):
            assert c.answers[rid].token_ids == reference(c, PROMPT[i:], 6)
        c.check_pages()
    finally:
        c.close()
