"""A router restarted on its endpoint (in one process, tests/unit/inproc.py): the decode
hands the old router's requests over, the new router rebuilds their flights and the
client resumes each with the count of tokens it has; what cannot be resumed ends 503,
and only the identity that sent a request gets it back."""
from __future__ import annotations

import orjson
import pytest

from tests.unit.inproc import Answer, InprocCluster, reference
from zpd.router.ha.adoption import CLAIM_S
from zpd.ops.router import build_router
from zpd.router.server import RouterServer
from zpd.wire.loop import Loop
from zpd.wire.net import Dealer
from zpd.wire.protocol import PROTOCOL_VERSION, Accepted, Adopt, Ping, Pong, Resume, Tokens
from zpd.wire.protocol import decode as decode_frames
from zpd.wire.resume import PROBE_S, Resumes
from zpd.wire.router_proof import load_router_secret, router_endpoint, router_identity
from zpd.worker.decode import DecodePhase

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]
N = 40


def restart_router(c: InprocCluster, silent_for: float = 0.0) -> RouterServer:
    """Kill the router (its sockets close, as at kill -9), let `silent_for` seconds pass,
    start another on its endpoint; the client reconnects with its identity."""
    cfg, old = c.router.cfg, c.router
    old.front.socket.unbind(old.endpoint)      # at once; a closed socket's endpoint frees later
    old.close()
    c.silent.add("router")
    if silent_for:
        c.advance(silent_for, step=1.0)
    else:
        c.pump(3)
    c.router = build_router(cfg, c.ctx, Loop(clock=c.clock))
    c.silent.discard("router")
    c.client.close()
    c.client = Dealer(c.ctx, c.router.endpoint, identity=b"client")
    assert c.router.boot != old.boot
    return old


def resume(c: InprocCluster, rid: str, have: int | None = None) -> None:
    got = c.answers.get(rid, Answer())
    c.client.send(Resume(rid, len(got.token_ids) if have is None else have))


def running(c: InprocCluster, n: int) -> None:
    c.until(lambda: [j.phase for j in c.decode.scheduler.jobs.values()] == [DecodePhase.RUNNING] * n)


@pytest.mark.parametrize("silent_for", [0.0, 4.0])        # before and after the decode's peer timeout
def test_streamed_requests_resume_with_every_token_once(cluster, silent_for):
    rids = [cluster.submit(PROMPT[i:], N) for i in range(2)]
    running(cluster, 2)
    cluster.until(lambda: all(len(cluster.answers.get(r, Answer()).token_ids) >= 3 for r in rids))
    restart_router(cluster, silent_for)
    cluster.pump(5)                                      # the decode hands them over
    assert set(cluster.router.adoption.unclaimed) == set(rids)
    decode = next(w for w in cluster.router.workers if w.role == "decode")
    assert decode.load == 2 and cluster.router.shares.routed(b"client") == 2
    for rid in rids:
        resume(cluster, rid)
    for i, rid in enumerate(rids):
        got = cluster.run(rid)
        assert got.token_ids == reference(cluster, PROMPT[i:], N) and got.finish["type"] == "length"
        assert len(got.weight_versions) == N
    assert cluster.router.inflight == {} and not cluster.router.adoption.unclaimed
    assert all(w.load == 0 for w in cluster.router.workers)
    cluster.check_pages()
    cluster.serves_again()


def test_a_request_not_streamed_gets_its_whole_answer(cluster):
    rid = cluster.submit(PROMPT, N, stream=False)
    running(cluster, 1)
    restart_router(cluster)
    cluster.pump(5)
    resume(cluster, rid, 0)
    assert cluster.run(rid).token_ids == reference(cluster, PROMPT, N)
    cluster.check_pages()


def test_a_request_that_ends_before_its_client_resumes_is_kept_for_it(cluster):
    rid = cluster.submit(PROMPT, 12)
    running(cluster, 1)
    restart_router(cluster)
    cluster.until(lambda: not cluster.decode.scheduler.jobs)        # finished, held by the router
    resume(cluster, rid)
    assert cluster.run(rid).token_ids == reference(cluster, PROMPT, 12)
    cluster.check_pages()


def test_requests_that_end_while_no_router_listens_are_kept_for_the_next(cluster):
    """Once a send to the dead router failed, what ends is kept whole: here a request
    not streamed ends during the outage, beside a stream that runs through it."""
    long, short = cluster.submit(PROMPT, 300), cluster.submit(PROMPT[2:], 8, stream=False)
    running(cluster, 2)
    restart_router(cluster, silent_for=4.0)        # 12 steps: `short` ends meanwhile
    assert [j.req.rid for j in cluster.decode.scheduler.jobs.values()] == [long]
    cluster.pump(5)
    assert set(cluster.router.adoption.unclaimed) == {long, short}
    resume(cluster, short, 0)
    assert cluster.run(short).token_ids == reference(cluster, PROMPT[2:], 8)
    resume(cluster, long)
    assert cluster.run(long, rounds=1000).token_ids == reference(cluster, PROMPT, 300)
    assert all(w.load == 0 for w in cluster.router.workers)
    cluster.check_pages()


def test_another_identity_resuming_a_request_gets_503_and_the_owner_its_tokens(cluster):
    rid = cluster.submit(PROMPT, N)
    running(cluster, 1)
    restart_router(cluster)
    cluster.pump(5)
    thief = Dealer(cluster.ctx, cluster.router.endpoint, identity=b"thief")
    try:
        thief.send(Resume(rid, 0))
        cluster.pump(5)
        got = [m for m in iter(lambda: thief.recv(), None)]
    finally:
        thief.close()
    (msg,) = got
    (part,) = msg.unpack()
    assert part.rid == rid and part.token_ids == [] and part.finish["status_code"] == 503
    assert rid in cluster.router.adoption.unclaimed               # still the owner's
    resume(cluster, rid)
    assert cluster.run(rid).token_ids == reference(cluster, PROMPT, N)
    cluster.check_pages()


def test_an_unknown_rid_and_a_forged_count_end_cleanly(cluster):
    rid = cluster.submit(PROMPT, N)
    running(cluster, 1)
    cluster.until(lambda: len(cluster.answers.get(rid, Answer()).token_ids) >= 2)
    restart_router(cluster)
    cluster.pump(5)
    cluster.client.send(Resume("never-sent", 3))
    have = len(cluster.answers[rid].token_ids)
    resume(cluster, rid, have + 5)                 # claims 5 tokens it never got: they are skipped
    got = cluster.run("never-sent")
    assert got.status == 503 and "router restarted" in got.finish["message"]
    out = cluster.run(rid).token_ids
    ref = reference(cluster, PROMPT, N)
    assert out == ref[:have] + ref[have + 5:]
    cluster.client.send(Resume(rid, 0))             # resumed already and finished: lost now
    cluster.pump(5)
    cluster.check_pages()


def test_a_request_nobody_resumes_is_aborted_and_its_pages_come_back(cluster):
    cluster.submit(PROMPT, 200)
    running(cluster, 1)
    restart_router(cluster)
    cluster.pump(5)
    assert cluster.router.adoption.unclaimed
    cluster.advance(CLAIM_S + 1, step=1.0)
    assert not cluster.router.adoption.unclaimed and cluster.router.inflight == {}
    cluster.until(lambda: not cluster.decode.scheduler.jobs)
    cluster.check_pages()


def test_resumes_wait_for_the_decodes_to_hand_over(cluster):
    rid = cluster.submit(PROMPT, N)
    running(cluster, 1)
    restart_router(cluster)
    cluster.silent.add("decode")                    # the decode has not answered adopt yet
    resume(cluster, rid)
    cluster.pump(3)
    assert cluster.router.adoption.waiting and not cluster.finished(rid)
    cluster.silent.discard("decode")
    assert cluster.run(rid).token_ids == reference(cluster, PROMPT, N)


def test_a_decode_that_hands_over_too_late_has_its_requests_aborted(cluster):
    rid = cluster.submit(PROMPT, 300)
    running(cluster, 1)
    restart_router(cluster)
    cluster.silent.add("decode")
    resume(cluster, rid)
    cluster.advance(2.5, step=0.5)                  # the router waits a peer timeout at most
    assert cluster.run(rid).status == 503
    cluster.silent.discard("decode")
    cluster.until(lambda: not cluster.decode.scheduler.jobs, rounds=20)   # aborted, not run on
    assert cluster.router.inflight == {}
    cluster.check_pages()


def test_a_malformed_handover_is_aborted_at_the_decode(cluster):
    """What a decode hands over is checked (its entries by the wire decode, its
    prefills by the router): an entry the router cannot use is aborted there, the
    others are adopted."""
    server = cluster.router
    decode = next(w for w in server.workers if w.role == "decode")
    prefill = cluster.prefill.endpoint
    good = {"owner": b"client".hex(), "prefill": prefill, "stream": True, "tokens": 9, "output": 0}
    bad = [[], {"owner": "zz", "prefill": prefill, "tokens": 1, "output": 0},
           good | {"prefill": ["x"]}, good | {"prefill": "127.0.0.1:1"}, good | {"output": -1},
           good | {"tokens": "9"}, good | {"owner": ""}]
    aborted = []
    decode.dealer.send = aborted.append
    requests = {"ok": good} | {f"bad{i}": b for i, b in enumerate(bad)}
    handed = decode_frames([orjson.dumps({"v": PROTOCOL_VERSION, "type": "adopted", "requests": requests})])
    server.adoption.on_adopted(decode, handed)
    assert set(server.inflight) == {"ok"} and set(server.adoption.unclaimed) == {"ok"}
    assert sorted(m.rid for m in aborted) == sorted(f"bad{i}" for i in range(len(bad)))
    assert decode.load == 1 and server.shares.routed(b"client") == 1


def test_a_router_restarted_in_a_retract_pause_takes_it_on_and_continues(cluster):
    rid = cluster.submit(PROMPT, N)
    running(cluster, 1)
    cluster.until(lambda: len(cluster.answers.get(rid, Answer()).token_ids) >= 3)
    assert cluster.admin("pause", mode="retract")["ok"]
    restart_router(cluster)
    cluster.pump(5)
    assert cluster.router.paused == "retract" and rid in cluster.router.adoption.unclaimed
    resume(cluster, rid)
    assert cluster.admin("continue")["ok"] and cluster.router.paused is None
    got = cluster.run(rid)
    assert got.token_ids == reference(cluster, PROMPT, N) and got.meta["retractions"] == 1
    cluster.check_pages()


# --- the decode's side ----------------------------------------------------------------------


def test_a_silent_routers_requests_run_for_the_grace_then_end(cluster):
    cluster.submit(PROMPT, 300)
    running(cluster, 1)
    cluster.advance(0.5)                            # the router has pinged the decode
    cluster.silent.add("router")
    cluster.advance(3.0, step=0.5)                  # silent: kept for a restarted router
    assert [j.phase for j in cluster.decode.scheduler.jobs.values()] == [DecodePhase.RUNNING]
    cluster.advance(cluster.decode.cfg.deadlines.router_grace, step=0.5)
    assert cluster.decode.scheduler.jobs == {}
    cluster.check_pages()


def test_only_a_gone_router_of_the_same_endpoint_is_adopted_from(cluster):
    """Another endpoint's router, or one of ours while ours still pings the decode (a
    second router printing the same endpoint), gets nothing."""
    rid = cluster.submit(PROMPT, 300)
    running(cluster, 1)
    cluster.advance(0.5)                            # the router has pinged the decode
    secret = load_router_secret(cluster.secret_file)
    for identity in (router_identity("elsewhere:1", "9.x", secret),
                     router_identity(cluster.router.endpoint, "9.x", secret)):
        other = Dealer(cluster.ctx, cluster.decode.endpoint, identity=identity)
        try:
            other.send(Adopt())
            cluster.pump(3)
            replies = [m for m in iter(lambda: other.recv(), None) if not isinstance(m, Ping)]
        finally:
            other.close()
        assert [r.requests for r in replies] == [{}], identity
    cluster.abort(rid)
    assert cluster.run(rid).status == 499
    cluster.check_pages()


def test_router_identities():
    assert router_endpoint(b"router@127.0.0.1:5757/12.ab") == b"127.0.0.1:5757"
    assert router_endpoint(b"router@[::1]:5757/12.ab") == b"[::1]:5757"
    for other in (b"client-ab", b"router@", b"router@x:1/", b"router@/12", b"\x00abc"):
        assert router_endpoint(other) is None


# --- the client's side ----------------------------------------------------------------------


def test_resumes_follow_the_boot_id_with_the_counts_received():
    r = Resumes(now=0.0)
    r.opened("a", 0.0)
    r.opened("b", 0.0)
    assert r.note(Accepted("a", "boot1"), 0.1) == [] and r.note(Accepted("b", "boot1"), 0.1) == []
    for part in Tokens(["a", "b"], [2, 1], [7, 8, 9], ["v"] * 3).unpack():
        r.got(part)
    assert r.note(Ping(1, 0.2, boot="boot1"), 0.2) == []                  # the same router
    assert r.note(Ping(2, 0.3), 0.3) == []                                # no boot: a worker's
    assert r.note(Pong(1, 0.4, boot="boot2"), 0.4) == [Resume("a", 2), Resume("b", 1)]
    assert r.note(Ping(3, 0.5, boot="boot2"), 0.5) == []                  # once per restart
    r.got(Tokens.abort("a", 503, "lost").unpack()[0])
    assert list(r.open) == ["b"]


def test_a_client_that_hears_nothing_pings_the_router():
    r = Resumes(now=0.0)
    assert r.probe(5.0) is None and r.wait(5.0) == float("inf")          # nothing open
    r.opened("a", 5.0)
    assert r.probe(5.0 + PROBE_S / 2) is None and r.wait(5.0) == PROBE_S
    assert isinstance(r.probe(5.0 + PROBE_S), Ping)
    assert r.probe(5.0 + PROBE_S) is None                                # once per PROBE_S
    r.note(Ping(0, 0.0, boot="x"), 9.0)
    assert r.probe(9.5) is None
