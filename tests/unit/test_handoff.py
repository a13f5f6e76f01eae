"""The prefill/decode handoff in one process (tests/unit/inproc.py): the real router,
schedulers and worker cores over inproc sockets and the fake transport, on a manual
clock. Each scenario checks the client's answer and that every KV page came back."""
from __future__ import annotations

import pytest

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.unit.inproc import InprocCluster, reference
from transport import FaultRule
from zpd.worker.decode import DecodePhase
from zpd.worker.prefill import JobPhase

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]   # 17 tokens: 2 pages


def decode_phases(c: InprocCluster) -> list[DecodePhase]:
    return [j.phase for j in c.decode.scheduler.jobs.values()]


def prefill_phases(c: InprocCluster) -> list[JobPhase]:
    return [j.phase for j in c.prefill.scheduler.jobs.values()]


# --- happy path ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
def test_greedy_output_equals_zpd_run(cluster, stream):
    rid = cluster.submit(PROMPT, 12, stream=stream)
    got = cluster.run(rid)
    assert got.finish["type"] == "length"
    assert got.token_ids == reference(cluster, PROMPT, 12)
    assert got.weight_versions == ["tiny"] * 12
    assert got.meta["prompt_tokens"] == len(PROMPT) and got.meta["retractions"] == 0
    cluster.check_pages()


def test_many_requests_at_once(cluster):
    prompts = [PROMPT[i:] for i in range(6)]
    rids = [cluster.submit(p, 5 + i) for i, p in enumerate(prompts)]
    for i, (rid, p) in enumerate(zip(rids, prompts)):
        assert cluster.run(rid).token_ids == reference(cluster, p, 5 + i)
    cluster.check_pages()


def test_the_decode_states_the_pages_it_holds_cached(cluster, monkeypatch):
    """A prefix page the decode has cached is not written again: its kv_dest says how
    many leading pages it holds (`cached_pages`) and lists the others only."""
    import zpd.worker.decode as decode_module
    from zpd.wire.protocol import KvDest
    sent = []
    monkeypatch.setattr(decode_module, "KvDest",
                        lambda *a, **kw: sent.append(KvDest(*a, **kw)) or sent[-1])
    for _ in range(2):
        rid = cluster.submit(PROMPT, 4)
        assert cluster.run(rid).token_ids == reference(cluster, PROMPT, 4)
    assert [(len(d.page_ids), d.cached_pages) for d in sent] == [(2, 0), (1, 1)]
    assert cluster.pages(cluster.decode)["cached"] == 1
    cluster.check_pages()


# --- aborts in every phase -------------------------------------------------------------


def test_abort_while_queued_on_both_sides(cluster):
    rid = cluster.submit(PROMPT, 8)
    cluster.abort(rid)                           # both reach the workers in one turn
    got = cluster.run(rid)
    assert got.status == 499 and got.token_ids == []
    cluster.pump()
    cluster.check_pages()
    cluster.serves_again()


def test_abort_while_decode_waits_for_pages():
    c = InprocCluster(kv_cache_mb=0.25)          # 16 pages of 16 tokens
    try:
        big = c.submit(PROMPT, 200)              # 14 pages
        c.until(lambda: DecodePhase.RUNNING in decode_phases(c))
        small = c.submit(PROMPT, 40)             # 4 more: it waits
        c.pump()
        assert DecodePhase.WAITING in decode_phases(c)
        c.abort(small)
        assert c.run(small).status == 499
        c.abort(big)
        assert c.run(big).status == 499
        c.pump()
        c.check_pages()
    finally:
        c.close()


def test_abort_while_kv_in_flight(cluster):
    """The decode has asked for the KV and the prefill does not answer yet: its pages
    stay fenced until the prefill acknowledges, then come back."""
    cluster.serves_again()                       # linked: kv_dest goes out at once
    cluster.silent.add("prefill")
    rid = cluster.submit(PROMPT, 8)
    cluster.until(lambda: cluster.decode.scheduler.jobs and
                  decode_phases(cluster) == [DecodePhase.TRANSFERRING] and
                  next(iter(cluster.decode.scheduler.jobs.values())).asked == 0)
    cluster.abort(rid)
    assert cluster.run(rid).status == 499
    assert cluster.pages(cluster.decode)["fenced"] > 0     # a write may still land
    cluster.silent.clear()
    cluster.until(lambda: cluster.pages(cluster.decode)["fenced"] == 0)
    cluster.pump()
    cluster.check_pages()
    cluster.serves_again()


def test_abort_while_prefill_waits_for_kv_dest(cluster):
    cluster.silent.add("decode")
    rid = cluster.submit(PROMPT, 8)
    cluster.until(lambda: prefill_phases(cluster) == [JobPhase.COMPUTED])
    cluster.abort(rid)
    cluster.pump()
    assert prefill_phases(cluster) == []
    cluster.silent.clear()
    assert cluster.run(rid).status == 499
    cluster.pump()
    cluster.check_pages()


def test_abort_while_writing():
    c = InprocCluster(complete_after_polls=10**9)     # the write never completes by itself
    try:
        rid = c.submit(PROMPT, 8)
        c.until(lambda: prefill_phases(c) == [JobPhase.WRITING])
        c.abort(rid)
        assert c.run(rid).status == 499
        c.until(lambda: not c.prefill.scheduler.writes)              # cancelled
        c.until(lambda: c.pages(c.decode)["fenced"] == 0)
        c.check_pages()
    finally:
        c.close()


def test_a_finished_write_is_reported_before_the_next_forward():
    """A write in flight when the next prompt's forward is due gets a moment to land
    first (KvWrites.settle, zpd/worker/writes.py): its kv_done goes out before that forward,
    not after it (a long prompt's forward would hold the decode, and the stream whose
    first token is out, for its whole length)."""
    c = InprocCluster(complete_after_polls=5)        # a few polls: not within one loop turn
    try:
        events, core, writes = [], c.prefill, c.prefill.scheduler.writes
        real_done, real_prefill = writes._done, core.compute.prefill
        writes._done = lambda job, *a: (events.append(("kv_done", job.room)), real_done(job, *a))[1]
        core.compute.prefill = lambda reqs, *a: (events.append(("forward", [r.rid for r in reqs])),
                                                 real_prefill(reqs, *a))[1]
        first = c.submit(PROMPT, 4)
        c.until(lambda: prefill_phases(c) == [JobPhase.WRITING])
        (room,) = [j.room for j in c.prefill.scheduler.jobs.values()]
        second = c.submit(PROMPT[3:], 4)
        c.until(lambda: len([e for e in events if e[0] == "forward"]) == 2)
        second_forward = [i for i, e in enumerate(events) if e[0] == "forward"][1]
        assert ("kv_done", room) in events[:second_forward]
        for rid, prompt in ((first, PROMPT), (second, PROMPT[3:])):
            assert c.run(rid).token_ids == reference(c, prompt, 4)
        c.check_pages()
    finally:
        c.close()


def test_abort_while_running(cluster):
    rid = cluster.submit(PROMPT, 200)
    cluster.until(lambda: len(cluster.answers.get(rid, None).token_ids
                              if rid in cluster.answers else []) >= 3)
    cluster.abort(rid)
    got = cluster.run(rid)
    assert got.status == 499
    assert got.token_ids == reference(cluster, PROMPT, len(got.token_ids))
    cluster.check_pages()


def test_abort_while_held(cluster):
    rid = cluster.submit(PROMPT, 200)
    cluster.until(lambda: rid in cluster.answers and len(cluster.answers[rid].token_ids) >= 2)
    assert cluster.admin("pause", mode="retract")["ok"]
    assert decode_phases(cluster) == [DecodePhase.HELD]
    cluster.abort(rid)
    assert cluster.run(rid).status == 499
    cluster.check_pages()
    assert cluster.admin("continue")["ok"]
    cluster.serves_again()


# --- kv_failed both ways ------------------------------------------------------------------


def test_failed_write_fails_the_request_and_tells_the_decode():
    c = InprocCluster(fault_plan=FaultRule("fail", count=1, reason="nic down"))
    try:
        rid = c.submit(PROMPT, 8)
        got = c.run(rid)
        assert got.status == 500 and "nic down" in got.finish["message"]
        c.check_pages()
        c.serves_again()
    finally:
        c.close()


def test_decode_deadline_tells_the_prefill(cluster):
    """kv_done never comes: the decode gives up (504) and tells the prefill, whose
    answer is what frees the fenced pages."""
    cluster.serves_again()
    cluster.silent.add("prefill")
    rid = cluster.submit(PROMPT, 8)
    cluster.pump()
    cluster.clock.now += cluster.decode.cfg.deadlines.wait_kv_done + 1
    cluster.pump(3)                             # no heartbeat ran: the prefill is not dead yet
    got = cluster.run(rid)
    assert got.status == 504 and "kv_done" in got.finish["message"]
    assert cluster.pages(cluster.decode)["fenced"] > 0
    cluster.silent.clear()
    cluster.until(lambda: cluster.pages(cluster.decode)["fenced"] == 0)
    cluster.pump()
    cluster.check_pages()


def test_kv_dest_before_generate_is_kept_then_expires(cluster):
    """A kv_dest for a room the prefill has not heard of waits (stash) for its generate;
    without one it expires, and the decode is told its pages are free."""
    cluster.serves_again()                       # the decode's hello is done
    prefill = cluster.prefill.scheduler
    identity = next(iter(prefill.peers))
    from zpd.wire.protocol import KvDest
    prefill.dests.on_kv_dest(identity, KvDest(room=77, epoch=0, rid="ghost", page_ids=[0, 1]))
    assert prefill_phases(cluster) == [JobPhase.STASHED]
    cluster.clock.now += cluster.prefill.cfg.deadlines.stash + 1
    cluster.pump(3)
    assert prefill_phases(cluster) == []
    cluster.check_pages()


# --- pause, continue, recompute --------------------------------------------------------------


def _mid_output(c: InprocCluster, max_new: int = 24, at: int = 4) -> str:
    rid = c.submit(PROMPT, max_new)
    c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) >= at)
    return rid


def test_retract_update_continue_is_old_then_new_weights(cluster):
    rid = _mid_output(cluster)
    assert cluster.admin("pause", mode="retract")["ok"]
    cluster.check_pages(idle=True)                       # no KV anywhere while held
    before = list(cluster.answers[rid].token_ids)
    assert cluster.admin("update_weights", path="tiny:7", version="v2")["ok"]
    assert cluster.admin("continue")["ok"]
    got = cluster.run(rid)
    assert got.token_ids[:len(before)] == before == reference_tiny("tiny", PROMPT, len(before))
    new = load_model("tiny:7", dtype="float64")
    assert got.token_ids == continuation(new, PROMPT, before, 24)
    assert got.weight_versions == ["tiny"] * len(before) + ["v2"] * (24 - len(before))
    assert got.meta["retractions"] == 1
    cluster.check_pages()


def test_pause_in_place_holds_then_continues(cluster):
    rid = _mid_output(cluster)
    assert cluster.admin("pause", mode="in_place")["ok"]
    n = len(cluster.answers[rid].token_ids)
    cluster.advance(70, step=1.0)                        # longer than every phase deadline
    assert len(cluster.answers[rid].token_ids) == n and not cluster.finished(rid)
    assert cluster.admin("continue")["ok"]
    assert cluster.run(rid).token_ids == reference(cluster, PROMPT, 24)
    cluster.check_pages()


def test_pause_abort_ends_everything(cluster):
    rid = _mid_output(cluster)
    assert cluster.admin("pause", mode="abort")["ok"]
    assert cluster.run(rid).status == 499
    cluster.check_pages()
    assert cluster.admin("continue")["ok"]
    cluster.serves_again()


def test_retract_reaching_the_prefill_first_holds_the_request(cluster):
    """The router fans the pause out to both workers at once. When the prefill drops
    its work before the decode has paused, the decode must hold the request (it is
    retracted, not failed) and recompute it after continue."""
    cluster.silent.add("prefill")
    rid = cluster.submit(PROMPT, 10)
    cluster.until(lambda: decode_phases(cluster) == [DecodePhase.TRANSFERRING])
    cluster.silent = {"decode"}                          # the prefill pauses first
    req_id = cluster.admin("pause", wait=False, mode="retract")
    cluster.until(lambda: not cluster.prefill.scheduler.jobs)
    cluster.silent.clear()
    cluster.until(lambda: req_id in cluster.replies)
    assert cluster.replies[req_id]["ok"] and not cluster.finished(rid)
    assert cluster.admin("continue")["ok"]
    got = cluster.run(rid)
    assert got.finish["type"] == "length" and got.token_ids == reference(cluster, PROMPT, 10)
    cluster.check_pages()


def test_pause_never_fails_a_request_its_prefill_drops_first():
    """Were the pause to reach a prefill before the decode, the prefill would drop a
    request mid-write and tell the decode (kv_failed) before the decode knew of any
    pause: the request would end with 499 instead of being held. The router pauses
    the decodes first, so the prefill has nothing to drop behind their back."""
    c = InprocCluster(fault_plan=FaultRule("hang", skip=1, count=1))   # the 2nd write hangs
    try:
        c.serves_again()
        rid = c.submit(PROMPT, 10)
        c.until(lambda: prefill_phases(c) == [JobPhase.WRITING])
        c.silent.add("decode")
        req_id = c.admin("pause", wait=False, mode="retract")
        c.pump(20)
        links = c.decode.scheduler.links
        for link in links.links.values():                # what the prefill sent goes first
            while link.dealer.socket.poll(0):
                links._on_readable(link)
        c.silent.clear()
        c.until(lambda: req_id in c.replies)
        assert c.replies[req_id]["ok"] and not c.finished(rid), c.answers.get(rid)
        assert c.admin("continue")["ok"]
        got = c.run(rid)
        assert got.finish["type"] == "length" and got.token_ids == reference(c, PROMPT, 10)
        assert got.meta["retractions"] == 1
        c.check_pages()
    finally:
        c.close()


# --- silent peers ---------------------------------------------------------------------------


def test_silent_prefill_fails_its_requests_with_503(cluster):
    cluster.serves_again()
    cluster.silent.add("prefill")
    rid = cluster.submit(PROMPT, 8)
    cluster.advance(3.0)                                 # peer timeout 2 s + a heartbeat
    got = cluster.run(rid)
    assert got.status == 503 and "unavailable" in got.finish["message"]
    cluster.silent.clear()                               # it wakes: answers for its room
    cluster.advance(1.0)
    cluster.until(lambda: cluster.pages(cluster.decode)["fenced"] == 0)
    cluster.serves_again()


def test_silent_router_orphans_are_ended(cluster):
    cluster.submit(PROMPT, 100)
    cluster.until(lambda: decode_phases(cluster) == [DecodePhase.RUNNING])
    cluster.advance(0.5)                                 # the router has pinged the decode
    cluster.silent.add("router")
    cluster.advance(3.0 + cluster.decode.cfg.deadlines.router_grace, step=1.0)   # no router took them
    assert cluster.decode.scheduler.jobs == {}
    cluster.check_pages()


# --- helpers -------------------------------------------------------------------------------


def reference_tiny(spec: str, prompt: list[int], n: int) -> list[int]:
    engine = OfflineEngine(load_model(spec, dtype="float64"), kv_cache_mb=1)
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return engine.run([Request("ref", prompt, params)])[0]["output_ids"]


def continuation(model, prompt: list[int], before: list[int], total: int) -> list[int]:
    """`before`, then what `model` generates greedily given prompt + before."""
    rest = reference_tiny_model(model, prompt + before, total - len(before))
    return before + rest


def reference_tiny_model(model, prompt: list[int], n: int) -> list[int]:
    engine = OfflineEngine(model, kv_cache_mb=1)
    params = SamplingParams(temperature=0, max_new_tokens=n, ignore_eos=True)
    return engine.run([Request("ref", prompt, params)])[0]["output_ids"]
