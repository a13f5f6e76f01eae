"""The HTTP front's asyncio router client against a scripted ROUTER socket on loopback:
chunks reach the right request, admin replies their caller, a closed stream aborts its
request, and a router that never answers ends requests with 503 instead of hanging."""
from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from engines.sampling_params import SamplingParams
from zpd.http.records import GenRequest
from zpd.http.router_client import USER, RouterClient, http_user
from zpd.wire.messages import MAX_USER_CHARS
from zpd.wire.protocol import (MAX_FRAME_BYTES, Abort, Accepted, Admin, AdminReply, Generate,
                               Ping, Resume, TokenPart, Tokens, decode, encode)


class ScriptedRouter:
    """A bound ROUTER that records what arrives; tests answer by hand."""

    def __init__(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"127.0.0.1:{port}"

    async def recv(self):
        identity, *frames = await asyncio.wait_for(self.sock.recv_multipart(), 5)
        return identity, decode(frames)

    async def send(self, identity: bytes, msg) -> None:
        await self.sock.send_multipart([identity, *encode(msg)])

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def run(test):
    async def go():
        router = ScriptedRouter()
        client = RouterClient(router.endpoint, connect_timeout=0.5, router_silence=1.0)
        await client.start()
        try:
            await test(router, client)
        finally:
            await client.close()
            router.close()
    asyncio.run(go())


async def collect(stream) -> list[dict]:
    return [c async for c in stream]


def test_tokens_go_to_their_request_and_admin_replies_to_their_caller():
    async def test(router, client):
        a = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="a"))))
        b = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), text="hi", rid="b"))))
        got = {}
        for _ in range(2):
            who, msg = await router.recv()
            assert isinstance(msg, Generate)
            got[msg.rid] = msg
        assert got["a"].input_ids == [1] and got["b"].text == "hi"
        await router.send(who, Accepted("a"))
        await router.send(who, Ping(1, 0.0))
        await router.send(who, Tokens.pack([TokenPart("a", [5], ["v"]), TokenPart("b", [6, 7], ["v", "v"])]))
        await router.send(who, Tokens.pack([
            TokenPart("b", [], [], {"type": "length"}, {"prompt_tokens": 2, "text": "xy"}),
            TokenPart("a", [8], ["v"], {"type": "stop"}, {"completion_tokens": 2})]))
        ca, cb = await a, await b
        assert [c["token_ids"] for c in ca] == [[5], [8]] and ca[-1]["finish_reason"] == {"type": "stop"}
        assert [c["token_ids"] for c in cb] == [[6, 7], []] and cb[-1]["text"] == "xy"
        admin = asyncio.create_task(client.admin("status"))
        _, msg = await router.recv()
        assert isinstance(msg, Admin) and msg.command == "status"
        await router.send(who, AdminReply(msg.req_id, True, {"workers": []}))
        assert await admin == {"ok": True, "workers": []}
    run(test)


def test_a_closed_stream_aborts_its_request():
    async def test(router, client):
        async def read_one():
            async for chunk in client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="x")):
                return chunk
        task = asyncio.create_task(read_one())
        who, _ = await router.recv()
        await router.send(who, Tokens.pack([TokenPart("x", [5], ["v"])]))
        assert (await task)["token_ids"] == [5]
        await asyncio.sleep(0)                    # the generator's close runs
        _, msg = await router.recv()
        assert isinstance(msg, Abort) and msg.rid == "x" and msg.status == 499
    run(test)


def test_no_acknowledgement_or_a_silent_router_ends_requests_with_503():
    async def test(router, client):
        chunks = await asyncio.wait_for(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1]))), 5)
        assert chunks[-1]["finish_reason"]["status_code"] == 503
        assert "no answer from the router" in chunks[-1]["finish_reason"]["message"]
        task = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="s"))))
        who, _ = await router.recv()
        await router.send(who, Accepted("s"))     # then silence
        chunks = await asyncio.wait_for(task, 5)
        assert chunks[-1]["finish_reason"]["status_code"] == 503
        assert "has not answered" in chunks[-1]["finish_reason"]["message"]
        reply = await client.admin("status", timeout=0.3)
        assert reply["ok"] is False and reply["status"] == 504
    run(test)


def test_a_rid_already_in_flight_is_refused_409():
    async def test(router, client):
        first = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="d"))))
        await router.recv()
        again = await collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="d")))
        assert again[-1]["finish_reason"]["status_code"] == 409
        first.cancel()
    run(test)


def test_a_sink_that_fails_ends_its_request_with_500_and_the_others_go_on():
    async def test(router, client):
        bad: list[dict] = []

        def fragile(chunk: dict) -> None:
            bad.append(chunk)
            if len(bad) == 1:
                raise RuntimeError("broken sink")
        client.open(GenRequest(SamplingParams(), input_ids=[1], rid="bad"), fragile)
        good = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[2], rid="ok"))))
        who, _ = await router.recv()
        await router.recv()
        await router.send(who, Tokens.pack([TokenPart("bad", [5], ["v"]), TokenPart("ok", [6], ["v"])]))
        _, msg = await router.recv()
        assert isinstance(msg, Abort) and msg.rid == "bad"
        await router.send(who, Tokens.pack([TokenPart("ok", [7], ["v"], {"type": "length"}, {})]))
        assert [c["token_ids"] for c in await asyncio.wait_for(good, 5)] == [[6], [7]]
        assert bad[-1]["finished"] and bad[-1]["finish_reason"]["status_code"] == 500
        assert "broken sink" in bad[-1]["finish_reason"]["message"]
    run(test)


def test_open_hands_every_chunk_to_its_sink_and_close_after_the_end_sends_nothing():
    async def test(router, client):
        got: list[dict] = []
        close = client.open(GenRequest(SamplingParams(), input_ids=[1], rid="s"), got.append)
        who, _ = await router.recv()
        await router.send(who, Tokens.pack([TokenPart("s", [5], ["v"])]))
        await router.send(who, Tokens.pack([TokenPart("s", [], [], {"type": "stop"}, {})]))
        for _ in range(100):
            if got and got[-1]["finished"]:
                break
            await asyncio.sleep(0.01)
        assert [c["token_ids"] for c in got] == [[5], []] and got[-1]["finished"]
        close()                              # after the end: no abort goes out
        status = asyncio.create_task(client.admin("status"))
        _, msg = await router.recv()
        assert isinstance(msg, Admin)
        await router.send(who, AdminReply(msg.req_id, True, {}))
        await status
    run(test)


# --- issue 30: the caller's identity, and no frame the router would refuse -------------


def test_each_request_names_its_http_caller_as_the_routers_user():
    async def test(router, client):
        async def as_user(user: str, rid: str) -> None:
            USER.set(user)                       # what the key check does per HTTP request
            client.open(GenRequest(SamplingParams(), input_ids=[1], rid=rid), lambda chunk: None)
        await asyncio.create_task(as_user("key:abc@10.0.0.7", "a"))
        await asyncio.create_task(as_user("10.0.0.8", "b"))
        client.open(GenRequest(SamplingParams(), input_ids=[1], rid="c"), lambda chunk: None)
        got = {}
        for _ in range(3):
            _, msg = await router.recv()
            got[msg.rid] = msg.user
        assert got == {"a": "key:abc@10.0.0.7", "b": "10.0.0.8", "c": ""}
    run(test)


def test_http_user_is_the_address_and_a_hash_of_the_key_never_the_key():
    assert http_user("10.1.2.3", b"", keyed=False) == "10.1.2.3"
    assert http_user("10.1.2.3", b"sekrit", keyed=False) == "10.1.2.3"    # no keys: not a key
    keyed = http_user("10.1.2.3", b"sekrit", keyed=True)
    assert keyed.startswith("key:") and keyed.endswith("@10.1.2.3") and "sekrit" not in keyed
    assert keyed != http_user("10.1.2.3", b"other", keyed=True)
    assert http_user(None, b"", keyed=False) == "unknown"
    assert len(http_user("f" * 300, b"k", keyed=True)) <= MAX_USER_CHARS


def test_a_request_too_large_for_one_router_frame_is_400_here_and_the_link_lives():
    """Issue 30 item 4: the router drops a connection that sends a frame past
    MAX_FRAME_BYTES, and with it every HTTP caller's stream; such a request must end
    at the front, for its caller only."""
    async def test(router, client):
        big = await asyncio.wait_for(collect(client.stream(
            GenRequest(SamplingParams(), text="a" * (MAX_FRAME_BYTES + 1), rid="big"))), 5)
        assert big[-1]["finish_reason"]["status_code"] == 400
        assert "too large" in big[-1]["finish_reason"]["message"]
        ids = await asyncio.wait_for(collect(client.stream(
            GenRequest(SamplingParams(), input_ids=[1] * (MAX_FRAME_BYTES // 4 + 1), rid="ids"))), 5)
        assert ids[-1]["finish_reason"]["status_code"] == 400
        small = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="ok"))))
        who, msg = await router.recv()
        assert isinstance(msg, Generate) and msg.rid == "ok"     # nothing big went out
        await router.send(who, Tokens.pack([TokenPart("ok", [5], ["v"], {"type": "length"}, {})]))
        assert (await asyncio.wait_for(small, 5))[-1]["token_ids"] == [5]
    run(test)


def test_a_request_whose_send_raises_leaves_its_rid_free():
    """A send that fails with an error of the socket (not a full queue): the caller gets
    the error, and its rid is not left taken (a retry would get 409 forever)."""
    async def test(router, client):
        real, sends = client._send, []

        def broken(*args):
            sends.append(args)
            raise zmq.ZMQError(zmq.EFSM, "injected")
        client._send = broken
        with pytest.raises(zmq.ZMQError):
            client.open(GenRequest(SamplingParams(), input_ids=[1], rid="r"), lambda chunk: None)
        assert sends and "r" not in client._sinks
        client._send = real
        again = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="r"))))
        who, msg = await router.recv()
        assert msg.rid == "r"
        await router.send(who, Tokens.pack([TokenPart("r", [5], ["v"], {"type": "length"}, {})]))
        assert (await asyncio.wait_for(again, 5))[-1]["token_ids"] == [5]
    run(test)


def test_a_restarted_router_gets_the_open_requests_resumed_from_the_same_identity():
    """The router's boot id changes (zpd/wire/resume.py): the front resumes each open
    request with the tokens it has, from the identity that sent it, and takes the rest."""
    async def test(router, client):
        a = asyncio.create_task(collect(client.stream(GenRequest(SamplingParams(), input_ids=[1], rid="a", stream=True))))
        who, msg = await router.recv()
        assert isinstance(msg, Generate)
        await router.send(who, Accepted("a", "boot1"))
        await router.send(who, Tokens.pack([TokenPart("a", [5, 6], ["v", "v"])]))
        await router.send(who, Ping(1, 0.0, boot="boot1"))         # the same router: nothing
        await router.send(who, Ping(2, 0.0, boot="boot2"))         # restarted
        again, resume = await router.recv()
        assert again == who and resume == Resume("a", 2)
        await router.send(who, Tokens.pack([TokenPart("a", [7], ["v"], {"type": "length"})]))
        assert [c["token_ids"] for c in await a] == [[5, 6], [7]]
    run(test)
