"""Several routers behind one client (zpd/failover.py): the policy on its own with a
clock passed in, then the HTTP front's router client and zpd.Client over two scripted
ROUTER sockets on loopback, one of which dies."""
from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

import orjson
import pytest
import zmq
import zmq.asyncio

from engines.sampling_params import SamplingParams
from zpd.client import Client
from zpd.config import HttpConfig
from zpd.failover import Routers, merge_replies, parse_routers
from zpd.http.records import GenRequest
from zpd.http.router_client import RouterClient
from zpd.ops.http_workers import _supervise
from zpd.wire.protocol import (Abort, Accepted, Admin, AdminReply, Generate, Ping, TokenPart,
                               Tokens, decode, encode)

A, B, C = "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"


# --- the policy ----------------------------------------------------------------------

def test_router_lists_parse_from_a_comma_string_or_a_list():
    assert parse_routers("127.0.0.1:1") == (A,)
    assert parse_routers(" 127.0.0.1:1, 127.0.0.1:2 ,") == (A, B)
    assert parse_routers([A, B]) == (A, B)
    for bad in ("", ",", "127.0.0.1", f"{A},{A}", [A, "x"]):
        with pytest.raises(ValueError):
            parse_routers(bad)


def test_each_client_keeps_to_its_own_router_and_two_over_two_routers_split_evenly():
    one, two = Routers((A, B), first=0), Routers((A, B), first=1)
    picks = Counter(r.pick(0.0) for r in (one, two) for _ in range(50))
    assert picks == {0: 50, 1: 50}
    assert Counter(Routers((A, B, C)).first for _ in range(300)).keys() == {0, 1, 2}


def test_a_router_down_is_skipped_until_its_retry_and_one_unplugged_until_it_reconnects():
    r = Routers((A, B, C), first=1, retry_s=5.0)
    r.link_event(1, zmq.EVENT_CONNECTED)                  # connected, then frozen
    r.down(1, now=10.0)
    assert [r.pick(11.0) for _ in range(2)] == [2, 2]      # the next after its own
    assert not r.up(1, 14.9) and r.up(1, 15.0)            # tried again after retry_s
    assert r.pick(15.0) == 1                               # and its own again once up
    assert r.link_event(1, zmq.EVENT_DISCONNECTED) is True
    assert r.pick(100.0) == 2                              # unplugged: no retry by time
    assert r.link_event(1, zmq.EVENT_CONNECTED) is False
    assert r.pick(100.0) == 1
    r.down(0, 100.0)                                      # never connected: nothing there
    assert not r.up(0, 1e6)                               # no retry by time either
    r.heard(0)                                            # it spoke: up at once
    assert r.up(0, 100.0)


def test_with_every_router_down_the_soonest_retry_is_tried_and_one_router_always():
    alone = Routers((A,), first=0)
    alone.down(0, 0.0)
    assert alone.pick(1.0) == 0 and alone.coordinator(1.0) == 0
    assert alone.next_up(1.0, avoid={0}) is None          # nothing to move a request to
    r = Routers((A, B), first=0, retry_s=5.0)
    r.down(0, now=2.0)
    r.down(1, now=1.0)
    assert r.pick(3.0) == 1                               # B's retry comes first
    assert r.next_up(3.0, avoid=()) is None
    assert r.fanned(3.0) == [0, 1]                        # status still goes everywhere


def test_admin_goes_to_the_first_router_up_and_status_to_every_router_up():
    r = Routers((A, B, C), first=2)
    assert r.coordinator(0.0) == 0
    r.down(0, 0.0)
    assert r.coordinator(1.0) == 1 and r.fanned(1.0) == [1, 2]
    r.heard(0)
    assert r.coordinator(1.0) == 0


# --- the HTTP front's router client ------------------------------------------------

class ScriptedRouter:
    """A bound asyncio ROUTER; the test answers by hand. `kill` drops its connections."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.endpoint = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    async def recv(self):
        """The next message but a client's probe (a Ping, zpd/wire/resume.py)."""
        while True:
            identity, *frames = await asyncio.wait_for(self.sock.recv_multipart(), 5)
            if not isinstance(msg := decode(frames), Ping):
                return identity, msg

    async def send(self, identity: bytes, msg) -> None:
        await self.sock.send_multipart([identity, *encode(msg)])

    def kill(self) -> None:
        self.sock.close(linger=0)


def run_front(test, connect_timeout: float = 0.5, router_silence: float = 30.0):
    async def go():
        ctx = zmq.asyncio.Context()
        a, b = ScriptedRouter(ctx), ScriptedRouter(ctx)
        client = RouterClient([a.endpoint, b.endpoint], connect_timeout=connect_timeout,
                              router_silence=router_silence, first=0)   # A is its own router
        await client.start()
        try:
            await test(a, b, client)
        finally:
            await client.close()
            for r in (a, b):
                r.kill()
            ctx.destroy(linger=0)
    asyncio.run(go())


async def collect(stream) -> list[dict]:
    return [c async for c in stream]


def finished(rid: str) -> Tokens:
    return Tokens.pack([TokenPart(rid, [5], ["v"], {"type": "length"}, {})])


def test_front_requests_go_to_its_router_and_a_dead_routers_requests_end_or_move():
    async def test(a, b, client):
        def start(rid: str) -> asyncio.Task:
            return asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid=rid))))
        r1, r2 = start("r1"), start("r2")
        (ia, ga), (_, g2) = await a.recv(), await a.recv()
        assert (ga.rid, g2.rid) == ("r1", "r2")
        await a.send(ia, Accepted("r1"))
        await a.send(ia, finished("r2"))
        assert (await r2)[-1]["finish_reason"] == {"type": "length"}
        assert not await b.sock.poll(0)
        r3 = start("r3")                          # sent, never acknowledged
        assert (await a.recv())[1].rid == "r3"
        began = time.monotonic()
        a.kill()                                  # r3 moves to B at once
        ib, moved = await b.recv()
        assert isinstance(moved, Generate) and moved.rid == "r3"
        assert time.monotonic() - began < 0.5     # the connection event, not a timeout
        await b.send(ib, finished("r3"))
        assert (await asyncio.wait_for(r3, 5))[-1]["finish_reason"] == {"type": "length"}
        assert not r1.done()                      # acknowledged: A may come back (resume)
        ended = await asyncio.wait_for(r1, 5)     # it does not: 503 after router_silence
        assert ended[-1]["finish_reason"]["status_code"] == 503
        assert "has not answered" in ended[-1]["finish_reason"]["message"]
        r4 = start("r4")                          # new requests: B only
        ib, new = await b.recv()
        assert new.rid == "r4"
        await b.send(ib, finished("r4"))
        await asyncio.wait_for(r4, 5)
    run_front(test, router_silence=1.0)


def test_front_a_request_not_acknowledged_in_time_goes_to_the_next_router():
    async def test(a, b, client):
        task = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="x"))))
        assert (await a.recv())[1].rid == "x"     # A says nothing
        ia, dropped = await a.recv()              # A is told to drop it
        assert isinstance(dropped, Abort) and dropped.rid == "x"
        ib, moved = await b.recv()
        assert moved.rid == "x"
        await a.send(ia, Tokens.pack([TokenPart("x", [9], ["v"])]))   # too late: ignored
        ia, again = await a.recv()
        assert isinstance(again, Abort) and again.rid == "x"
        await b.send(ib, finished("x"))
        chunks = await asyncio.wait_for(task, 5)
        assert [c["token_ids"] for c in chunks] == [[5]]
    run_front(test, connect_timeout=0.2)


def test_front_admin_goes_to_the_first_router_up_only():
    async def test(a, b, client):
        resume = asyncio.create_task(client.admin("continue"))
        ia, msg = await a.recv()
        assert isinstance(msg, Admin) and msg.command == "continue"
        await a.send(ia, AdminReply(msg.req_id, True, {"router": "A"}))
        assert (await resume)["router"] == "A"
        abort = asyncio.create_task(client.admin("abort_all"))   # A finds every router's
        ia, msg = await a.recv()
        await a.send(ia, AdminReply(msg.req_id, True, {"aborted": 3}))
        assert (await abort)["aborted"] == 3
        assert not await b.sock.poll(0)           # B heard nothing of either
        a.kill()
        for _ in range(200):                      # the drop reaches the client's monitor
            if not client.routers.up(0, client._now()):
                break
            await asyncio.sleep(0.01)
        status = asyncio.create_task(client.admin("pause", mode="abort"))
        ib, msg = await b.recv()
        assert msg.command == "pause"
        await b.send(ib, AdminReply(msg.req_id, True, {"router": "B"}))
        assert (await status)["router"] == "B"
    run_front(test)


def test_front_status_waits_for_the_coordinator_not_for_a_silent_second_router(monkeypatch):
    monkeypatch.setattr("zpd.http.router_client.PEER_WAIT_S", 0.2)

    async def test(a, b, client):
        status = asyncio.create_task(client.admin("status", timeout=30))
        ia, msg = await a.recv()
        _, silent = await b.recv()                # B never answers
        assert msg.command == silent.command == "status" and silent.args["timeout"] < 0.2
        await a.send(ia, AdminReply(msg.req_id, True, {"router": A, "inflight": 1,
                                                       "workers": [], "counters": {}}))
        reply = await asyncio.wait_for(status, 2)
        assert reply["router"] == A and reply["inflight"] == 1
        assert [r["ok"] for r in reply["routers"]] == [True, False]
    run_front(test)


# --- zpd.Client ------------------------------------------------------------------------

class SyncRouter:
    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.endpoint = f"127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"

    def recv(self):
        """The next message but a client's probe (a Ping, zpd/wire/resume.py)."""
        while True:
            assert self.sock.poll(5000), "nothing arrived"
            identity, *frames = self.sock.recv_multipart()
            if not isinstance(msg := decode(frames), Ping):
                return identity, msg

    def send(self, identity: bytes, msg) -> None:
        self.sock.send_multipart([identity, *encode(msg)])


def test_client_moves_unacknowledged_requests_and_ends_a_dead_routers_with_503():
    ctx = zmq.Context()
    a, b = SyncRouter(ctx), SyncRouter(ctx)
    try:
        with Client(f"{a.endpoint},{b.endpoint}", timeout=10, connect_timeout=3,
                    router_silence=1.0) as client:
            client.routers.first = 0                          # A is its own router
            assert client.submit(input_ids=[1], rid="r1") == "r1"
            client.submit(input_ids=[1], rid="r2")
            (ia, ga), (_, g2) = a.recv(), a.recv()
            assert (ga.rid, g2.rid) == ("r1", "r2")
            a.send(ia, Accepted("r1"))
            a.send(ia, finished("r2"))
            assert client.receive()["rid"] == "r2"
            client.submit(input_ids=[1], rid="r3")            # never acknowledged
            assert a.recv()[1].rid == "r3"
            assert not b.sock.poll(0)                         # B has nothing yet
            a.sock.close(linger=0)                            # A dies: r3 moves to B,
            got = client.receive()                            # r1 waits for a resume
            assert got["rid"] == "r1" and got["finish_reason"]["status_code"] == 503
            assert "has not answered" in got["finish_reason"]["message"]
            ib, moved = b.recv()
            assert moved.rid == "r3"
            b.send(ib, finished("r3"))
            assert client.receive()["rid"] == "r3"
            client.submit(input_ids=[1], rid="r4")            # new ones: B only
            ib, new = b.recv()
            assert new.rid == "r4"
            b.send(ib, finished("r4"))
            assert client.receive()["rid"] == "r4"
            assert client.routers.coordinator(time.monotonic()) == 1   # admin: to B
    finally:
        b.sock.close(linger=0)
        ctx.destroy(linger=0)


def test_client_with_one_silent_router_raises_no_answer_as_before():
    ctx = zmq.Context()
    a = SyncRouter(ctx)
    try:
        with Client(a.endpoint, timeout=10, connect_timeout=0.2) as client:
            client.submit(input_ids=[1], rid="s")
            with pytest.raises(TimeoutError, match="no answer from router"):
                client.receive()
    finally:
        a.sock.close(linger=0)
        ctx.destroy(linger=0)


def test_status_of_several_routers_is_the_first_answer_with_router_figures_summed():
    workers = [{"role": "decode", "endpoint": "w", "ok": True}]
    a = {"ok": True, "router": A, "inflight": 2, "queued": 1, "workers": workers, "paused": None,
         "counters": {"generation_tokens": 10, "finished": {"length": 3}, "gen_throughput": 1.5}}
    b = {"ok": True, "router": B, "inflight": 1, "queued": 0, "workers": workers, "paused": None,
         "counters": {"generation_tokens": 5, "finished": {"length": 1, "stop": 2},
                      "gen_throughput": 0.5}}
    late = {"ok": False, "status": 504, "error": "no answer"}
    merged = merge_replies("status", [a, b, late])
    assert merged["workers"] == workers and merged["router"] == A
    assert (merged["inflight"], merged["queued"]) == (3, 1)
    assert merged["counters"] == {"generation_tokens": 15, "finished": {"length": 4, "stop": 2},
                                  "gen_throughput": 2.0}
    assert [r["router"] for r in merged["routers"]] == [A, B, None]
    assert merge_replies("status", [late, b])["router"] == B     # the first that answered


# --- zpd http --workers N: the parent's policy ---------------------------------------

class FakeFronts:
    """Fronts as `_supervise` sees them: scripted deaths, no processes."""

    def __init__(self, deaths: list[list[tuple[int, int, float]]], stopping: list) -> None:
        self.deaths, self.stopping, self.started = deaths, stopping, []
        self.running = {100: (0, 0.0), 101: (1, 0.0)}

    def all_ready(self) -> bool:
        return True

    def reap(self) -> list[tuple[int, int, float]]:
        if not self.deaths:
            self.stopping.append(15)             # SIGTERM once the script is done
            return []
        return self.deaths.pop(0)

    def start(self, index: int) -> None:
        self.started.append(index)


def supervise(deaths, tmp_path) -> tuple[int, FakeFronts, dict]:
    stopping: list = []
    fronts = FakeFronts(deaths, stopping)
    ready = tmp_path / "ready.json"
    cfg = HttpConfig(workers=2, ready_file=str(ready))
    rc = _supervise(cfg, fronts, "127.0.0.1:9", stopping, poll_s=0)
    return rc, fronts, orjson.loads(ready.read_bytes())


def test_a_front_that_dies_after_its_start_is_started_again(tmp_path):
    rc, fronts, ready = supervise([[], [(1, -9, 60.0)], []], tmp_path)
    assert rc == 0 and fronts.started == [1]
    assert ready["endpoint"] == "127.0.0.1:9" and ready["workers"] == [100, 101]


def test_a_front_that_dies_soon_after_its_start_stops_them_all(tmp_path):
    rc, fronts, _ = supervise([[(0, 1, 2.0)]], tmp_path)
    assert rc == 1 and fronts.started == []


def test_client_status_goes_to_both_and_a_silent_one_costs_peer_wait_only(monkeypatch):
    monkeypatch.setattr("zpd.client.PEER_WAIT_S", 0.2)
    ctx = zmq.Context()
    a, b = SyncRouter(ctx), SyncRouter(ctx)
    try:
        with Client([a.endpoint, b.endpoint], timeout=10) as client:
            def answer() -> None:
                ia, msg = a.recv()
                a.send(ia, AdminReply(msg.req_id, True, {"router": A, "inflight": 2,
                                                         "workers": [{"ok": True}]}))
            helper = threading.Thread(target=answer)
            helper.start()
            began = time.monotonic()
            merged = client.admin("status")
            assert merged["router"] == A and merged["inflight"] == 2
            assert [r["ok"] for r in merged["routers"]] == [True, False]   # B: 504
            assert time.monotonic() - began < 5
            helper.join(5)
            assert b.recv()[1].command == "status"        # B was asked too
    finally:
        for r in (a, b):
            r.sock.close(linger=0)
        ctx.destroy(linger=0)
