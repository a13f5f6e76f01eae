"""Issue 43, item 2 and the forged adopt: a peer that names a router's identity on a
decode's socket must get none of its requests' tokens, neither while the router is
connected nor in the gap between its death and its restart, and the real router (or
its successor) must keep serving. The attacker is a second ZeroMQ connection that
knows all a client can learn: the router's endpoint and its boot id (in every Pong)."""
from __future__ import annotations

import zmq

from engines.sampling_params import SamplingParams
from tests.unit.inproc import Answer, InprocCluster, reference
from tests.unit.test_router_restart import PROMPT, resume, running
from zpd.ops.router import build_router
from zpd.wire.loop import Loop
from zpd.wire.net import Dealer
from zpd.wire.protocol import Adopt, Adopted, Ping, Tokens
from zpd.wire.router_proof import load_router_secret, proven_router, router_identity

N = 60


def learnable_identity(c: InprocCluster) -> bytes:
    """The router's name as a client can spell it: its endpoint and the boot id its
    Pong carries (the router's whole identity before issue 43)."""
    c.pong = None
    c.client.send(Ping(1, 0.0))
    c.until(lambda: c.pong is not None)
    return f"router@{c.router.endpoint}/{c.pong.boot}".encode()


def routers_identity(c: InprocCluster) -> bytes:
    """The identity the router really uses (as if it had leaked)."""
    return c.router.workers[0].dealer.socket.getsockopt(zmq.IDENTITY)


def tokens_to(attacker: Dealer) -> int:
    """Tokens (and Adopted entries) that reached the attacker's connection."""
    got = 0
    while (msg := attacker.recv()) is not None:
        if isinstance(msg, Tokens):
            got += len(msg.token_ids) + sum(1 for p in msg.unpack() if p.finished)
        elif isinstance(msg, Adopted):
            got += len(msg.requests)
    return got


def test_a_peer_that_names_the_routers_identity_gets_none_of_its_tokens(cluster):
    """While the router is connected: its learnable name is not its identity, and a
    second connection with the identity itself is refused (no handover)."""
    rid = cluster.submit(PROMPT, N)
    running(cluster, 1)
    cluster.until(lambda: len(cluster.answers.get(rid, Answer()).token_ids) >= 3)
    for claimed in (learnable_identity(cluster), routers_identity(cluster)):
        attacker = Dealer(cluster.ctx, cluster.decode.endpoint, identity=claimed)
        try:
            attacker.send(Ping(0, 0.0))
            cluster.pump(20)
            stolen = tokens_to(attacker)
        finally:
            attacker.close()
        assert stolen == 0, claimed
    got = cluster.run(rid)
    assert got.token_ids == reference(cluster, PROMPT, N) and got.finish["type"] == "length"
    cluster.check_pages()
    cluster.serves_again()


def test_a_forged_adopt_between_a_routers_death_and_its_restart_gets_nothing(cluster):
    """Keyless: the old router is gone, a process named like a router of its endpoint
    asks the decode to adopt, or claims the dead router's learnable name; it receives
    nothing, and the real successor adopts every request."""
    old_name = learnable_identity(cluster)
    rids = [cluster.submit(PROMPT[i:], N) for i in range(2)]
    running(cluster, 2)
    cluster.until(lambda: all(len(cluster.answers.get(r, Answer()).token_ids) >= 3 for r in rids))
    old = cluster.router
    old.front.socket.unbind(old.endpoint)
    old.close()
    cluster.silent.add("router")
    stolen = 0
    for claimed in (f"router@{old.endpoint}/1.forged".encode(), old_name):
        attacker = Dealer(cluster.ctx, cluster.decode.endpoint, identity=claimed)
        try:
            attacker.send(Adopt())
            cluster.advance(1.0)
            stolen += tokens_to(attacker)
        finally:
            attacker.close()
    assert stolen == 0
    cluster.router = build_router(old.cfg, cluster.ctx, Loop(clock=cluster.clock))   # its successor
    cluster.silent.discard("router")
    cluster.client.close()
    cluster.client = Dealer(cluster.ctx, cluster.router.endpoint, identity=b"client")
    cluster.pump(5)
    assert set(cluster.router.adoption.unclaimed) == set(rids)
    for rid in rids:
        resume(cluster, rid)
    for i, rid in enumerate(rids):
        assert cluster.run(rid).token_ids == reference(cluster, PROMPT[i:], N)
    cluster.check_pages()


def test_only_the_secrets_holder_makes_a_proven_identity(tmp_path):
    from zpd.wire.router_proof import write_router_secret
    secret = load_router_secret(write_router_secret(tmp_path / "s"))
    other = load_router_secret(write_router_secret(tmp_path / "t"))
    mine = router_identity("127.0.0.1:5757", "12.ab", secret)
    assert mine.startswith(b"router@127.0.0.1:5757/12.ab.") and proven_router(mine, secret)
    assert not proven_router(mine, other) and not proven_router(mine, None)
    assert not proven_router(b"router@127.0.0.1:5757/12.ab", secret)
    assert not proven_router(mine[:-1] + b"0", secret) or mine.endswith(b"0")
    keyless = router_identity("127.0.0.1:5757", "12.ab", None)
    assert keyless != router_identity("127.0.0.1:5757", "12.ab", None)     # a nonce each time


def test_with_a_router_secret_workers_take_requests_only_from_the_routers(cluster):
    """Keyless, a worker that holds the cluster's router secret answers a request sent
    straight to it with 403: only the routers assign rooms and peers."""
    from zpd.wire.protocol import Generate
    for worker in (cluster.prefill, cluster.decode):
        intruder = Dealer(cluster.ctx, worker.endpoint, identity=b"router@x:1/2.3")
        try:
            intruder.send(Generate("mine", PROMPT, SamplingParams(max_new_tokens=4), False, 7, 0,
                                   cluster.prefill.endpoint, cluster.decode.endpoint))
            for _ in range(50):
                cluster.pump(1)
                msg = intruder.recv()
                if isinstance(msg, Tokens):
                    break
            assert isinstance(msg, Tokens) and msg.unpack()[0].finish["status_code"] == 403
        finally:
            intruder.close()
    assert cluster.decode.scheduler.jobs == {}
    cluster.check_pages()
    cluster.serves_again()


def test_a_router_secret_others_may_read_or_a_short_one_is_refused(tmp_path):
    import os

    import pytest

    from zpd.wire.router_proof import RouterSecretError, write_router_secret
    path = write_router_secret(tmp_path / "s")
    assert os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(RouterSecretError, match="exists already"):
        write_router_secret(path)
    os.chmod(path, 0o640)
    with pytest.raises(RouterSecretError, match="chmod 600"):
        load_router_secret(path)
    short = tmp_path / "short"
    short.write_text("abc")
    os.chmod(short, 0o600)
    with pytest.raises(RouterSecretError, match="fewer than"):
        load_router_secret(short)
    with pytest.raises(RouterSecretError, match="cannot read"):
        load_router_secret(tmp_path / "none")


def test_zpd_keys_writes_a_router_secret(tmp_path, capsys):
    import argparse

    from zpd.ops.keys import run_keys
    run_keys(argparse.Namespace(dir=str(tmp_path / "k"), router_secret=True, add=None))
    assert load_router_secret(tmp_path / "k" / "router.secret")
    assert "--router-secret-file" in capsys.readouterr().out
