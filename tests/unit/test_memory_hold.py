"""Generation while memory is released (issue 46, item 6): a request sent after
release_memory waits in the router's queue, as in a pause, never sent to a worker
(which would wait for KV pages until its deadline: 504), and runs after
resume_memory; one still waiting after --queue-timeout ends 503 "memory released".
A whole cluster in one process (inproc.py), on its manual clock."""
from __future__ import annotations

from tests.unit.inproc import InprocCluster, reference

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31]


def held(c: InprocCluster, rid: str) -> bool:
    """Queued at the router, unknown to both workers."""
    return rid in c.router.queued and rid not in c.router.inflight and \
        not c.prefill.scheduler.jobs and not c.decode.scheduler.jobs


def test_a_request_after_release_waits_for_resume_then_runs_exactly():
    c = InprocCluster()
    try:
        released = c.admin("release_memory")
        assert released["ok"] and {w["endpoint"] for w in released["memory_released"]} == \
            {c.prefill.endpoint, c.decode.endpoint}
        rid = c.submit(PROMPT, 6)
        c.advance(70.0)              # past the workers' KV wait (60 s): 504 there before
        assert held(c, rid) and not c.finished(rid)
        assert c.admin("status")["memory_released"]
        resumed = c.admin("resume_memory")
        assert resumed["ok"] and resumed["memory_released"] == []
        assert c.run(rid).token_ids == reference(c, PROMPT, 6)
        c.check_pages()
    finally:
        c.close()


def test_weights_alone_released_hold_requests_too():
    c = InprocCluster()
    try:
        assert c.admin("release_memory", tags=["weights"])["ok"]
        rid = c.submit(PROMPT, 3)
        c.pump(5)
        assert held(c, rid)
        assert c.admin("resume_memory", tags=["weights"])["ok"]
        assert c.run(rid).token_ids == reference(c, PROMPT, 3)
    finally:
        c.close()


def test_held_past_the_queue_timeout_it_ends_503_memory_released():
    c = InprocCluster(router_args={"queue_timeout": 5.0})
    try:
        assert c.admin("release_memory")["ok"]
        rid = c.submit(PROMPT, 4)
        c.advance(4.5)
        assert held(c, rid) and not c.finished(rid)
        c.advance(1.0)               # unlike a pause, the queue's clock runs
        got = c.answers[rid]
        assert got.status == 503 and got.finish["message"].startswith("memory released")
        assert "/resume_memory_occupation" in got.finish["message"] and got.finish["retry_after"] > 0
        assert got.token_ids == [] and rid not in c.router.queued
        assert c.admin("resume_memory")["ok"]
        c.serves_again()
    finally:
        c.close()
