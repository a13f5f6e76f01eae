"""zpd.Client fails fast where no router answers, and the router acknowledges every
generate at once (routed, queued while paused, or refused)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from engines.sampling_params import SamplingParams
from tests.unit.fake_workers import FakeCluster
from zpd.client import Client, NoAnswerError
from zpd.config import RouterConfig
from zpd.ops.router import build_router
from zpd.router.server import RouterServer
from zpd.wire import protocol as p
from zpd.wire.net import Router

ROOT = Path(__file__).resolve().parents[2]
CONNECT = 1.0
SLACK = 1.0     # thread start, a loaded machine


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)       # term() would hang on a socket a failed test left open


@pytest.fixture
def router(ctx: zmq.Context) -> Iterator[RouterServer]:
    """A real router whose workers never answer (and are never declared dead here)."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        workers = (f"127.0.0.1:{a.getsockname()[1]}",), (f"127.0.0.1:{b.getsockname()[1]}",)
    server = build_router(RouterConfig(*workers, port=0, peer_timeout=600.0), ctx)
    stop = threading.Event()
    thread = threading.Thread(target=server.run, args=(stop,), daemon=True)
    thread.start()
    yield server
    stop.set()
    server.loop.stop()
    thread.join(5)
    server.close()


@pytest.mark.parametrize("call", ["generate", "generate_many", "stream", "receive"])
def test_nothing_listening_fails_within_connect_timeout(dead_endpoint: str, call: str) -> None:
    with Client(dead_endpoint, timeout=60, connect_timeout=CONNECT) as client:
        start = time.monotonic()
        with pytest.raises(NoAnswerError) as exc:
            if call == "generate":
                client.generate(input_ids=[1, 2, 3])
            elif call == "generate_many":
                client.generate_many([{"input_ids": [1]}, {"prompt": "hi"}])
            elif call == "stream":
                list(client.stream(input_ids=[1, 2, 3]))
            else:
                client.submit(input_ids=[1, 2, 3])
                client.receive(timeout=30)
        took = time.monotonic() - start
    assert isinstance(exc.value, TimeoutError)
    assert CONNECT * 0.9 <= took <= CONNECT + SLACK, took
    assert dead_endpoint in str(exc.value) and "router" in str(exc.value)


def test_the_overdue_request_is_reported_once(dead_endpoint: str) -> None:
    """After the error, a later call waits as usual (a plain timeout)."""
    with Client(dead_endpoint, timeout=60, connect_timeout=0.2) as client:
        client.submit(input_ids=[1])
        with pytest.raises(NoAnswerError):
            client.receive(timeout=5)
        with pytest.raises(TimeoutError) as exc:
            client.receive(timeout=0.3)
        assert not isinstance(exc.value, NoAnswerError)


def test_an_acknowledged_request_may_take_longer(ctx: zmq.Context) -> None:
    """The acknowledgement, not the first token, is due within connect_timeout."""
    fake = Router(ctx, "127.0.0.1", 0)
    try:
        with Client(fake.endpoint, timeout=30, connect_timeout=0.3) as client:
            rid = client.submit(input_ids=[1, 2], rid="slow")
            identity, msg = fake.recv(timeout=5)
            assert isinstance(msg, p.Generate) and msg.rid == rid
            fake.send(identity, p.Accepted(rid))
            time.sleep(0.8)
            fake.send(identity, p.Tokens.pack([p.TokenPart(rid, [5], ["v"], {"type": "length"})]))
            chunk = client.receive(timeout=5)
        assert chunk["rid"] == rid and chunk["token_ids"] == [5] and chunk["finished"]
    finally:
        fake.close()


def test_bad_sampling_is_refused_at_the_client_as_the_router_would(ctx: zmq.Context) -> None:
    """The client is the edge: it checks the parameters once and answers 400 naming
    the bad one; nothing is sent, so no router is needed."""
    fake = Router(ctx, "127.0.0.1", 0)
    try:
        with Client(fake.endpoint, timeout=5, connect_timeout=0.3) as client:
            out = client.generate(input_ids=[1], sampling_params={"top_p": 7})
            (chunk,) = list(client.stream(input_ids=[1], sampling_params={"bogus": 1}))
            assert fake.recv(timeout=0.2) is None
        assert out["finish_reason"]["status_code"] == 400 and "top_p" in out["finish_reason"]["message"]
        assert chunk["finished"] and "bogus" in chunk["finish_reason"]["message"]
    finally:
        fake.close()


def test_the_client_sends_its_record_as_given(ctx: zmq.Context) -> None:
    fake = Router(ctx, "127.0.0.1", 0)
    try:
        with Client(fake.endpoint, timeout=5, connect_timeout=0.3) as client:
            params = SamplingParams(temperature=0, max_new_tokens=3, stop=("x",))
            client.submit(input_ids=[1], sampling_params=params, rid="r")
            client.submit(input_ids=[1], sampling_params=params.to_dict(), rid="d")
            got = [fake.recv(timeout=5)[1] for _ in range(2)]
        assert [m.sampling for m in got] == [params, params] and not any(m.refused for m in got)
    finally:
        fake.close()


def test_a_listener_that_never_acknowledges_is_no_router(ctx: zmq.Context) -> None:
    fake = Router(ctx, "127.0.0.1", 0)
    try:
        with Client(fake.endpoint, timeout=30, connect_timeout=0.3) as client:
            with pytest.raises(NoAnswerError, match=fake.endpoint):
                client.generate(input_ids=[1])
    finally:
        fake.close()


def test_router_acknowledges_routed_queued_and_refused(router: RouterServer) -> None:
    with Client(router.endpoint, timeout=30, connect_timeout=0.5) as client:
        client.submit(input_ids=[1, 2, 3], rid="routed")
        # Its workers never answer: a plain timeout, long after the acknowledgement.
        with pytest.raises(TimeoutError) as exc:
            client.receive(timeout=1.5)
        assert not isinstance(exc.value, NoAnswerError)
        client.submit(input_ids=[4], rid="routed")            # a rid already in flight
        chunk = client.receive(timeout=5)
        assert chunk["rid"] == "routed" and chunk["finish_reason"]["status_code"] == 409
        assert not client.admin("pause", mode="in_place", timeout=0.5)["ok"]   # no worker answers
        client.submit(input_ids=[5], rid="queued")
        with pytest.raises(TimeoutError) as exc:
            client.receive(timeout=1.5)
        assert not isinstance(exc.value, NoAnswerError)
        assert client.admin("abort", rid="queued")["state"] == "queued"
        assert client.receive(timeout=5)["finish_reason"]["status_code"] == 499


def test_cli_generate_fails_fast_naming_the_address(dead_endpoint: str) -> None:
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "zpd", "generate", "--router", dead_endpoint,
                          "--input-ids", "1,2,3", "--connect-timeout", "1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - start
    assert out.returncode != 0 and dead_endpoint in out.stderr, out.stderr
    assert "zpd generate: error: no answer from router" in out.stderr, out.stderr
    assert took < 15, took      # interpreter and torch import included; not the 300 s timeout


def test_a_client_submitting_more_than_its_share_at_once_has_none_refused() -> None:
    """Issue 30: 1,100 requests from one zpd.Client once got 76 refusals (503 "busy",
    past --max-client-requests 1024); now the ones past its share or past
    --max-concurrent-requests wait their turn, and the decode never holds more."""
    cluster = FakeCluster(hold=0.002)
    try:
        with Client(cluster.endpoint, timeout=120, connect_timeout=10) as client:
            out = client.generate_many([{"input_ids": [1, 2, 3]} for _ in range(1100)])
        assert [r["finish_reason"] for r in out] == [{"type": "length"}] * 1100
        assert len(cluster.decode.seen) == 1100
        assert cluster.decode.most <= cluster.router.max_concurrent == 64
        assert cluster.router.shares.held == {} and len(cluster.router.queued) == 0
    finally:
        cluster.close()
