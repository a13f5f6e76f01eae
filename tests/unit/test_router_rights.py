"""Issue 43, items 3 and 7, over real sockets: who may send a router's restart and
follower messages. Under CURVE a client resumes its requests (a client right: the
front's admin key and zpd.Client's client key), and only a cluster key follows; without
keys only a router proven by the cluster's router secret follows."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from tests.unit.inproc import InprocCluster
from tests.unit.test_security import WAIT, _dealer, _next
from zpd.router.ha.peers import MAX_FOLLOWERS
from zpd.wire.net import Dealer, Router
from zpd.wire.protocol import Admin, AdminReply, Resume
from zpd.wire.router_proof import load_router_secret, router_identity
from zpd.wire.security import ROUTER_POLICY, Security, client_curve, create_keys

curve = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rights") / "k"
    create_keys(root)
    return root


@pytest.fixture
def front(keys: Path) -> Iterator[tuple[zmq.Context, Router]]:
    ctx = zmq.Context()
    sec = Security(str(keys), ctx)
    router = Router(ctx, "127.0.0.1", 0, sec.server_options(ROUTER_POLICY))
    yield ctx, router
    router.close()
    sec.close()
    ctx.destroy(linger=0)


@curve
@pytest.mark.parametrize("name", ["client", "admin"])
def test_a_client_or_admin_key_resumes_after_a_router_restart(front, keys, name):
    ctx, router = front
    client = _dealer(ctx, router.endpoint, client_curve(keys, name))
    client.send(Resume("r1", 3))
    got = _next(router, WAIT)
    assert got is not None and isinstance(got[1], Resume) and got[1].have == 3
    assert router.refused == 0


@curve
@pytest.mark.parametrize("name", ["client", "admin"])
def test_only_a_cluster_key_follows(front, keys, name):
    ctx, router = front
    fake = _dealer(ctx, router.endpoint, client_curve(keys, name))
    fake.send(Admin("follow", {"endpoint": "127.0.0.1:1", "inflight": 10**9}, "f"))
    reply = None
    for _ in range(int(WAIT / 0.05)):         # the guard runs as the router reads
        assert router.recv(timeout=0.05) is None
        if (reply := fake.recv()) is not None:
            break
    assert isinstance(reply, AdminReply) and reply.result["status"] == 403
    real = _dealer(ctx, router.endpoint, client_curve(keys, "cluster"))
    real.send(Admin("follow", {"endpoint": "127.0.0.1:1", "inflight": 0}, "f"))
    got = _next(router, WAIT)
    assert got is not None and got[1].command == "follow"


def answer(c: InprocCluster, dealer: Dealer) -> AdminReply:
    for _ in range(200):
        c.pump(1)
        msg = dealer.recv()
        if isinstance(msg, AdminReply):
            return msg
    raise AssertionError("no answer")


def test_keyless_fake_followers_are_refused_and_change_nothing():
    """A client (any identity, even one named like a router) that says it follows with
    10**9 requests in flight is refused: nothing waits for it, nothing counts it."""
    c = InprocCluster()
    try:
        names = [b"client-x", f"router@{c.router.endpoint}/1.2.3".encode()] + \
            [f"router@127.0.0.1:{p}/1.2".encode() for p in range(MAX_FOLLOWERS)]
        fakes = [Dealer(c.ctx, c.router.endpoint, identity=n) for n in names]
        for fake in fakes:
            fake.send(Admin("follow", {"endpoint": "127.0.0.1:1", "inflight": 10**9}, "f"))
        for fake in fakes:
            reply = answer(c, fake)
            assert reply.result["status"] == 403 and "router-secret-file" in reply.result["error"]
            fake.close()
        assert c.router.running() == 0 and c.admin("status")["followers"] == []
        paused = c.admin("pause", mode="retract")
        assert paused["ok"] and paused["followers"] == [], paused
        assert c.admin("release_memory")["ok"]
        assert c.admin("resume_memory")["ok"] and c.admin("continue")["ok"]
    finally:
        c.close()


def test_a_proven_follower_is_held_to_its_own_endpoint_and_bounds():
    c = InprocCluster()
    try:
        secret = load_router_secret(c.secret_file)
        identity = router_identity("inproc://f9", "1.2", secret)
        follower = Dealer(c.ctx, c.router.endpoint, identity=identity)
        for args in ({"endpoint": "inproc://f9", "inflight": 10**9},        # past MAX_INFLIGHT
                     {"endpoint": "inproc://other", "inflight": 0}):         # not its own
            follower.send(Admin("follow", args, "f"))
            assert answer(c, follower).result["status"] == 400
        follower.send(Admin("follow", {"endpoint": "inproc://f9", "inflight": 2}, "f"))
        assert answer(c, follower).ok and c.router.running() == 2
        follower.close()
    finally:
        c.close()
