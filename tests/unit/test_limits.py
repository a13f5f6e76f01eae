"""Resource limits (issue #11, finding 7): caps on a request's prompt and stop
conditions, each client's share of the router, and --max-batch as a true bound on
the decode. Cluster scenarios run in one process (tests/unit/inproc.py)."""
from __future__ import annotations

import time

import pytest

from zpd.wire.status import StatusError
from engines.sampling_params import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, SamplingParams
from tests.unit.inproc import InprocCluster, reference, send_raw
from zpd.limits import PromptLimits
from zpd.router.shares import ClientShares
from zpd.wire.net import Dealer
from zpd.wire.protocol import Generate, Ping, Pong
from zpd.worker.decode import DecodePhase

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]
CAPS = PromptLimits()
GREEDY = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)


def router_alone(c: InprocCluster) -> InprocCluster:
    """The workers' loops stand still: an answer can only be the router's."""
    c.silent |= {"prefill", "decode"}
    return c


# --- stop conditions ------------------------------------------------------------------


@pytest.mark.parametrize("bad, name", [
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ["x" * (MAX_STOP_CHARS + 1)]}, "stop"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids")])
def test_stop_conditions_are_capped(bad, name):
    with pytest.raises(ValueError, match=f"^{name} must be at most"):
        SamplingParams.from_dict(bad)


def test_stop_conditions_at_their_caps_are_accepted():
    p = SamplingParams.from_dict({"stop": ["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS,
                                  "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS))})
    assert len(p.stop) == MAX_STOP_STRINGS and len(p.stop_token_ids) == MAX_STOP_TOKEN_IDS


def test_too_many_stops_get_400_from_the_workers(cluster):
    rid = "stops"
    send_raw(cluster.client, Generate(rid, PROMPT), GREEDY.to_wire() | {"stop": ["s"] * 100_000})
    got = cluster.run(rid)
    assert got.status == 400 and got.finish["message"].startswith("stop must be at most")
    cluster.pump()
    cluster.check_pages()


# --- prompt size ----------------------------------------------------------------------


def test_router_refuses_an_oversized_text_before_routing(cluster):
    router_alone(cluster).client.send(Generate("big", [], GREEDY, text="a" * (CAPS.max_text_bytes + 1)))
    got = cluster.run("big")
    assert got.status == 400 and "max-text-bytes" in got.finish["message"]
    assert not cluster.router.inflight


def test_router_refuses_too_many_input_ids(cluster):
    router_alone(cluster).client.send(Generate("long", [1] * (CAPS.max_input_ids + 1), GREEDY))
    got = cluster.run("long")
    assert got.status == 400 and "max-input-ids" in got.finish["message"]
    assert not cluster.router.inflight


def test_text_cap_counts_utf8_bytes():
    caps = PromptLimits(max_text_bytes=10)
    assert caps.refusal([], "a" * 10) is None
    assert "max-text-bytes" in caps.refusal([], "é" * 6)          # 6 characters, 12 bytes
    assert "max-input-ids" in PromptLimits(max_input_ids=3).refusal([1, 2, 3, 4], "")


def test_prompt_caps_must_fit_one_wire_frame():
    with pytest.raises(ValueError, match="max_text_bytes"):
        PromptLimits(max_text_bytes=64 << 20)
    with pytest.raises(ValueError, match="max_input_ids"):
        PromptLimits(max_input_ids=0)


def test_worker_refuses_an_oversized_text_without_tokenizing(cluster, monkeypatch):
    core = cluster.prefill
    monkeypatch.setattr(core.model.tokenizer, "encode", lambda text: pytest.fail("tokenized"))
    with pytest.raises(StatusError) as e:
        core.prompt_ids(Generate("w", [], text="é" * (CAPS.max_text_bytes // 2 + 1)))
    assert e.value.status == 400 and "max-text-bytes" in str(e.value)


def test_pings_are_answered_while_a_long_text_is_tokenized(cluster, monkeypatch):
    """A 5 MiB text once took the scheduler thread 4 s outside the busy responder: the
    router declared both workers dead. Tokenizing is a long call like a forward."""
    core = cluster.prefill
    tokenize, pongs = core.model.tokenizer.encode, []
    prober = Dealer(cluster.ctx, core.endpoint, identity=b"prober")

    def slow_encode(text: str) -> list[int]:
        prober.send(Ping(seq=1, sent_at=0.0))
        pongs.append(prober.recv(timeout=3.0))      # the responder wakes after 0.5 s
        return tokenize(text)

    monkeypatch.setattr(core.model.tokenizer, "encode", slow_encode)
    try:
        cluster.client.send(Generate("t", [], GREEDY, text="hello world"))
        got = cluster.run("t")
    finally:
        prober.close()
    assert isinstance(pongs[0], Pong)
    assert got.finish["type"] == "length" and len(got.token_ids) == 4
    cluster.check_pages()


# --- each client's share of the router -----------------------------------------------


# A client past its share now waits its turn: tests/unit/test_router_queue.py.


def test_one_request_larger_than_a_whole_share_is_400():
    c = InprocCluster(router_args={"max_client_tokens": 10})
    try:
        got = c.run(c.submit(PROMPT, 4))
        assert got.status == 400 and "max-client-tokens" in got.finish["message"]
        assert c.router.shares.held == {}
    finally:
        c.close()


def test_share_comes_back_on_abort_queue_and_refusal(cluster):
    c = cluster
    c.admin("pause", mode="in_place")
    queued = c.submit(PROMPT, 4)
    c.pump(2)
    assert queued in c.router.queued and c.router.shares.held == {}   # charged once routed
    c.abort(queued)
    assert c.run(queued).status == 499
    bad = c.submit(PROMPT, 4, sampling={"temperature": -1})    # the workers refuse it (400)
    c.admin("continue")
    assert c.run(bad).status == 400
    running = c.submit(PROMPT, 50)
    c.until(lambda: running in c.answers and c.answers[running].token_ids)
    c.abort(running)
    assert c.run(running).status == 499
    assert c.router.shares.held == {}
    c.pump()
    c.check_pages()


def test_share_comes_back_when_its_client_hangs_up(cluster):
    c = cluster
    gone = Dealer(c.ctx, c.router.endpoint, identity=b"gone")
    c.admin("pause", mode="in_place")
    gone.send(Generate("queued", PROMPT, GREEDY))
    c.pump(2)
    assert c.router.admission.of_client(b"gone") == ["queued"]
    gone.close()
    # ZeroMQ's I/O thread drops the client's pipe on its own time, not the test
    # clock's: on a loaded machine a ping can still go through just after close().
    deadline = time.monotonic() + 10.0
    while len(c.router.queued) and time.monotonic() < deadline:
        c.advance(0.25)                            # the router's pings find it gone
        time.sleep(0.01)
    assert c.router.shares.held == {} and not c.router.queued
    c.admin("continue")


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


def test_a_share_must_admit_one_request():
    with pytest.raises(ValueError, match="max-client-requests"):
        ClientShares(0, 100)
