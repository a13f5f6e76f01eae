"""CURVE security over real loopback sockets, without model processes: key
layout, who may send what, refusals, and that the bytes on the wire are encrypted."""
from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engines.kv.layout import KVLayout
from engines.sampling_params import SamplingParams
from zpd.wire.net import Curve, Dealer, Router, SocketOptions
from zpd.wire.protocol import Admin, AdminReply, Generate, Hello, TokenPart, Tokens
from zpd.wire.security import (ROUTER_POLICY, WORKER_POLICY, Security, SecurityError, client_curve,
                          create_keys, rights_of)

pytestmark = pytest.mark.skipif(not zmq.has("curve"), reason="libzmq built without CURVE")

WAIT = 5.0        # never reached when things work
REFUSED = 1.0     # how long a refused message is given to (wrongly) arrive
HELLO = Hello("x", KVLayout(1, 1, 1, 1, "float32", 4), "h", "s", [], 0, "v")


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("keys") / "k"
    create_keys(root)
    return root


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


@pytest.fixture
def server(keys: Path, ctx: zmq.Context) -> Iterator[tuple[Router, Security]]:
    """A router-role bound socket with the ZAP handler running."""
    sec = Security(str(keys), ctx)
    router = Router(ctx, "127.0.0.1", 0, sec.server_options(ROUTER_POLICY))
    yield router, sec
    router.close()
    sec.close()


def _next(router: Router, timeout: float):
    """The next accepted message; recv returns None early for each refused one."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        got = router.recv(timeout=left)
        if got is not None:
            return got
    return None


def _dealer(ctx: zmq.Context, endpoint: str, curve: Curve | None) -> Dealer:
    return Dealer(ctx, endpoint, opts=SocketOptions(curve=curve))


def test_key_layout_and_no_overwrite(keys: Path) -> None:
    for name in ("server", "cluster", "admin", "client"):
        assert (keys / f"{name}.key").exists() and (keys / f"{name}.key_secret").exists()
        assert (keys / f"{name}.key_secret").stat().st_mode & 0o077 == 0
    assert rights_of(keys, client_curve(keys, "admin").public) == "admin"
    assert rights_of(keys, client_curve(keys, "cluster").public) == "cluster"
    assert rights_of(keys, zmq.curve_keypair()[0]) is None
    with pytest.raises(SecurityError):
        create_keys(keys)
    with pytest.raises(SecurityError, match="zpd keys"):
        client_curve(keys.parent / "nowhere")


def test_authorised_client_submits_but_cannot_administer(server, ctx, keys) -> None:
    router, _ = server
    client = _dealer(ctx, router.endpoint, client_curve(keys, "client"))
    client.send(Generate("r1", [1, 2, 3], SamplingParams(), False))
    identity, msg = _next(router, WAIT)
    assert isinstance(msg, Generate) and msg.rid == "r1"
    router.send(identity, Tokens.pack([TokenPart("r1", [7], ["v"], {"type": "stop"})]))
    assert client.recv(timeout=WAIT).token_ids == [7]      # and the reply comes back
    client.send(Admin("pause", {"mode": "abort"}, "q1"))
    assert _next(router, REFUSED) is None
    reply = client.recv(timeout=WAIT)
    assert isinstance(reply, AdminReply) and not reply.ok and reply.result["status"] == 403
    assert router.refused == 1


def test_admin_key_administers(server, ctx, keys) -> None:
    router, _ = server
    admin = _dealer(ctx, router.endpoint, client_curve(keys, "admin"))
    admin.send(Admin("status", {}, "q2"))
    _, msg = _next(router, WAIT)
    assert isinstance(msg, Admin) and msg.req_id == "q2"


def test_unknown_key_and_plaintext_are_refused(server, ctx, keys, caplog) -> None:
    router, _ = server
    stranger_public, stranger_secret = zmq.curve_keypair()
    stranger = _dealer(ctx, router.endpoint,
                       Curve(stranger_public, stranger_secret, client_curve(keys).server_public))
    plain = _dealer(ctx, router.endpoint, None)
    with caplog.at_level(logging.WARNING, logger="zpd.wire.security"):
        for i, peer in enumerate((stranger, plain)):
            peer.send(Generate(f"bad{i}", [1], SamplingParams(), False))
            peer.send(Admin("status", {}, f"bad{i}"))
        assert _next(router, REFUSED) is None
        assert stranger.recv(timeout=0.1) is None and plain.recv(timeout=0.1) is None
    text = caplog.text
    assert f"refused CURVE key {stranger_public.decode()}" in text
    # Which side notices the mechanism mismatch first varies, and so does the hint.
    assert "peer speaks plaintext" in text or "peer without --curve-keys" in text


def test_worker_takes_requests_and_control_only_from_the_cluster_key(keys, ctx) -> None:
    sec = Security(str(keys), ctx)
    worker = Router(ctx, "127.0.0.1", 0, sec.server_options(WORKER_POLICY))
    try:
        client = _dealer(ctx, worker.endpoint, client_curve(keys, "client"))
        client.send(Generate("direct", [1], SamplingParams(), False))
        client.send(HELLO)
        assert _next(worker, REFUSED) is None
        token = client.recv(timeout=WAIT)
        assert isinstance(token, Tokens)
        (part,) = token.unpack()
        assert part.rid == "direct" and part.finished and part.finish["status_code"] == 403
        cluster = _dealer(ctx, worker.endpoint, sec.client_options().curve)
        cluster.send(HELLO)
        assert isinstance(_next(worker, WAIT)[1], Hello)
    finally:
        worker.close()
        sec.close()


def test_plaintext_process_cannot_reach_a_keyed_one(keys, ctx, caplog) -> None:
    """The cluster-side view of a worker started without keys: the keyed side's
    handshake fails and says why."""
    plain_worker = Router(ctx, "127.0.0.1", 0)
    sec = Security(str(keys), ctx)
    try:
        with caplog.at_level(logging.WARNING, logger="zpd.wire.security"):
            dealer = Dealer(ctx, plain_worker.endpoint, opts=sec.client_options())
            dealer.send(HELLO)
            assert _next(plain_worker, REFUSED) is None
        assert f"refused connection on tcp://{plain_worker.endpoint}" in caplog.text
    finally:
        plain_worker.close()
        sec.close()


class _Tap:
    """A TCP relay that records every byte the client sends."""

    def __init__(self, target: str) -> None:
        host, port = target.rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        upstream = socket.create_connection(self.target)
        threading.Thread(target=self._pipe, args=(upstream, conn, False), daemon=True).start()
        self._pipe(conn, upstream, True)

    def _pipe(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        while data := src.recv(65536):
            if record:
                self.seen += data
            dst.sendall(data)


@pytest.mark.parametrize("encrypted", [False, True])
def test_bytes_on_the_wire(keys, ctx, encrypted: bool) -> None:
    """The control case (plaintext) proves the tap sees the message, so the
    encrypted case's absence of the secret means encryption, not a broken tap."""
    sec = Security(str(keys) if encrypted else None, ctx)
    router = Router(ctx, "127.0.0.1", 0, sec.server_options(ROUTER_POLICY))
    try:
        tap = _Tap(router.endpoint)
        client = _dealer(ctx, tap.endpoint, client_curve(keys) if encrypted else None)
        client.send(Generate("secret-rid", [1], SamplingParams(), False, text="attack at dawn"))
        assert _next(router, WAIT)[1].text == "attack at dawn"
        assert (b"attack at dawn" in tap.seen) is not encrypted
    finally:
        router.close()
        sec.close()


@pytest.fixture
def no_chmod_and_open_umask(monkeypatch):
    """Secret files must be private from the moment they exist: with chmod gone and a
    umask that takes nothing away, only the mode they are created with is left."""
    import os
    monkeypatch.setattr(Path, "chmod", lambda *a, **k: None)
    monkeypatch.setattr(os, "chmod", lambda *a, **k: None)
    old = os.umask(0)
    yield
    os.umask(old)


def test_secret_key_files_are_created_private(tmp_path, no_chmod_and_open_umask) -> None:
    import argparse
    from zpd.ops.keys import run_keys
    root = tmp_path / "k"
    create_keys(root)
    run_keys(argparse.Namespace(dir=str(root), add="alice", rights="client"))
    secrets = sorted(root.glob("*.key_secret"))
    assert [p.stem for p in secrets] == ["admin", "alice", "client", "cluster", "server"]
    for path in secrets:
        assert path.stat().st_mode & 0o777 == 0o600, path
    assert rights_of(root, client_curve(root, "alice").public) == "client"


def test_a_secret_key_file_planted_in_advance_is_not_written_through(tmp_path) -> None:
    root, target = tmp_path / "k", tmp_path / "elsewhere"
    root.mkdir()
    (root / "admin.key_secret").symlink_to(target)
    with pytest.raises((SecurityError, FileExistsError)):
        create_keys(root)
    assert not target.exists()


@pytest.mark.parametrize("name", ["../alice", "a/b", "", ".hidden"])
def test_an_added_key_is_named_plainly(tmp_path, name) -> None:
    import argparse
    from zpd.ops.keys import run_keys
    create_keys(tmp_path / "k")
    with pytest.raises(SecurityError, match="plain name"):
        run_keys(argparse.Namespace(dir=str(tmp_path / "k"), add=name, rights="client"))
    assert not list(tmp_path.glob("*.key*"))
