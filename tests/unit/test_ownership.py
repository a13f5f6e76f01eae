"""A request belongs to the client that submitted it (tests/unit/inproc.py): another
client cannot abort it, not even by borrowing its owner's ZeroMQ identity; the owner's
abort always ends it with 499 whatever status it asks for; an admin may abort any."""
from __future__ import annotations

import logging


from tests.unit.inproc import InprocCluster, reference
from zpd.wire.net import Dealer
from zpd.wire.protocol import Abort, Admin, AdminReply

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8]


def _other(c: InprocCluster, identity: bytes = b"other") -> Dealer:
    return Dealer(c.ctx, c.router.endpoint, identity=identity)


def _started(c: InprocCluster, max_new: int = 12) -> str:
    rid = c.submit(PROMPT, max_new)
    c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) >= 2)
    return rid


def test_another_client_cannot_abort_a_running_request(cluster, caplog):
    rid = _started(cluster)
    other = _other(cluster)
    try:
        with caplog.at_level(logging.WARNING, logger="zpd.router.server"):
            other.send(Abort(rid, 503, "forged"))
            got = cluster.run(rid)
        assert got.finish["type"] == "length"
        assert got.token_ids == reference(cluster, PROMPT, 12)
        assert "does not own it" in caplog.text
        assert other.recv() is None                    # no answer: nothing to learn from it
        cluster.check_pages()
    finally:
        other.close()


def test_borrowing_the_owners_identity_does_not_help(cluster):
    """A ROUTER that hands an identity over to its newest connection would let anyone
    who names the owner's identity take its route, its tokens and its requests."""
    rid = _started(cluster, 30)
    impostor = _other(cluster, b"client")
    try:
        impostor.send(Abort(rid, 503, "forged"))
        got = cluster.run(rid)
        assert got.finish["type"] == "length" and len(got.token_ids) == 30
        assert impostor.recv() is None
    finally:
        impostor.close()


def test_the_owners_abort_is_always_499(cluster):
    rid = _started(cluster, 200)
    cluster.client.send(Abort(rid, 503, "line one\nERROR forged line"))
    got = cluster.run(rid)
    assert got.status == 499 and "\n" not in got.finish["message"]
    cluster.pump()
    cluster.check_pages()


def test_queued_requests_are_owned_too(cluster):
    assert cluster.admin("pause", mode="in_place")["ok"]
    rid = cluster.submit(PROMPT, 4)
    cluster.pump()
    other = _other(cluster)
    try:
        other.send(Abort(rid, 503, "forged"))
        cluster.pump()
        assert rid in cluster.router.queued and not cluster.finished(rid)
        cluster.client.send(Abort(rid, 503, "mine"))
        assert cluster.run(rid).status == 499
    finally:
        other.close()
    assert cluster.admin("continue")["ok"]


def test_an_admin_aborts_any_clients_request(cluster):
    rid = _started(cluster, 200)
    admin = _other(cluster, b"admin")
    try:
        admin.send(Admin("abort", {"rid": rid}, "q"))
        got = cluster.run(rid)
        assert got.status == 499 and "admin" in got.finish["message"]
        cluster.until(lambda: admin.socket.poll(0))
        reply = admin.recv()
        assert isinstance(reply, AdminReply) and reply.ok and reply.result["state"] == "inflight"
    finally:
        admin.close()
    cluster.pump()
    cluster.check_pages()


def test_only_cluster_keys_abort_at_a_worker():
    """With CURVE, a worker takes an abort only from a cluster key (the router's): a
    client or admin key cannot end a request there behind the router's back."""
    from zpd.wire.security import WORKER_POLICY, Guard
    guard = Guard(WORKER_POLICY)
    for user in ("client", "admin"):
        assert guard(user, b"router@x:1/2.3", Abort("r", 499)) is not None
    assert guard("cluster", b"x", Abort("r", 499)) is None
