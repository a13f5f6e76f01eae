"""Issue 30 item 5: the HTTP front names each caller to the router, so one HTTP call
(8 prompts x n 128) no longer takes the front's whole router quota: another caller's
request is served at the next free slot. And a request the router's queue refuses
answers its status with Retry-After."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from engines.sampling_params import SamplingParams
from tests.unit.fake_workers import FakeCluster
from tests.unit.http_fake import FakeBackend, call, front
from tests.unit.test_http_router_client import ScriptedRouter
from zpd.http.guard.plug import guarded_app
from zpd.http.records import GenRequest
from zpd.http.router_client import CALL, USER, RouterClient
from zpd.wire.protocol import Accepted, TokenPart, Tokens


class UserRecorder(FakeBackend):
    """Records the user each request was opened for."""

    def __init__(self) -> None:
        super().__init__()
        self.users: list[str] = []
        self.calls: list[str] = []

    def open(self, req, sink):
        self.users.append(USER.get())
        self.calls.append(CALL.get())
        return super().open(req, sink)


def test_each_http_caller_is_its_address_or_its_keys_hash_never_the_key():
    backend = UserRecorder()
    assert call(front(backend), "POST", "/generate", {"input_ids": [1]})[0] == 200
    assert backend.users == ["127.0.0.1"]
    keyed = UserRecorder()
    headers = {"Authorization": "Bearer sekrit-key"}
    assert call(front(keyed, api_key="sekrit-key"), "POST", "/generate",
                {"input_ids": [[1], [2]]}, headers=headers)[0] == 200
    assert len(keyed.users) == 2 and keyed.users[0] == keyed.users[1]
    assert keyed.users[0].startswith("key:") and keyed.users[0].endswith("@127.0.0.1")
    assert "sekrit" not in keyed.users[0]


def test_each_http_request_is_a_call_of_its_own_that_its_requests_share():
    """The router's third level of fairness: one caller's calls take turns, so its
    second call is not served after the whole of its first (issue 43)."""
    backend = UserRecorder()
    app = front(backend)
    assert call(app, "POST", "/generate", {"input_ids": [[1], [2], [3]]})[0] == 200
    assert call(app, "POST", "/v1/completions", {"prompt": [1], "max_tokens": 2})[0] == 200
    assert backend.users == ["127.0.0.1"] * 4
    first, second = backend.calls[:3], backend.calls[3]
    assert len(set(first)) == 1 and first[0] and second and second != first[0]


def test_another_callers_request_passes_a_flood_from_one_http_call():
    cluster = FakeCluster(hold=0.01, max_concurrent_requests=4)

    async def go() -> tuple[list[str], int]:
        client = RouterClient(cluster.endpoint, connect_timeout=10, router_silence=30)
        await client.start()
        done: list[str] = []
        finished = asyncio.Event()

        def sink(chunk: dict) -> None:
            if chunk["finished"]:
                assert chunk["finish_reason"] == {"type": "length"}, chunk
                done.append(chunk["rid"])
                if len(done) == 201:
                    finished.set()

        async def submit(user: str, rids: list[str]) -> None:
            USER.set(user)                      # what the key check does per HTTP request
            for rid in rids:
                client.open(GenRequest(SamplingParams(), input_ids=[1], rid=rid), sink)
        try:
            await asyncio.create_task(submit("10.0.0.1", [f"a{i}" for i in range(200)]))
            await asyncio.sleep(0.05)           # the flood is at the router first
            before = len(done)
            await asyncio.create_task(submit("10.0.0.2", ["b"]))
            await asyncio.wait_for(finished.wait(), 60)
        finally:
            await client.close()
        return done, before

    try:
        done, before = asyncio.run(go())
    finally:
        cluster.close()
    # b waits for one of the four slots, not for the ~180 of a's requests queued before it
    assert before < 150 and done.index("b") - before <= 8, (before, done.index("b"))
    assert sorted(done) == sorted([f"a{i}" for i in range(200)] + ["b"])


REFUSABLE = {  # a route and a body it takes, without and with stream
    "/v1/completions": lambda stream: {"prompt": [1, 2], "max_tokens": 2, "stream": stream},
    "/generate": lambda stream: {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2},
                                 "stream": stream},
}


@pytest.mark.parametrize("path", sorted(REFUSABLE))
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("status, message", [(429, "queue full: 9 wait"),
                                             (503, "queue timeout: waited 300 s")])
def test_a_queue_refusal_answers_its_status_with_retry_after(path, stream, status, message):
    """The router's queue refused the request before it ran: the route answers that
    status with Retry-After (native /generate too: not a 200 whose finish_reason says
    abort), streamed or not; another request of the same front is untouched."""
    async def go() -> tuple[int, str | None, dict, int, str | None]:
        router = ScriptedRouter()
        client = RouterClient(router.endpoint, connect_timeout=5, router_silence=30)
        await client.start()
        f = front(client)
        try:
            async with TestClient(TestServer(guarded_app(f))) as http:
                refused = asyncio.create_task(http.post(path, json=REFUSABLE[path](stream)))
                who, msg = await router.recv()
                await router.send(who, Accepted(msg.rid))
                await router.send(who, Tokens.pack([TokenPart(msg.rid, [], [], {
                    "type": "abort", "status_code": status, "message": message,
                    "retry_after": 7}, {})]))
                resp = await refused
                body = await resp.json()
                served = asyncio.create_task(http.post(path, json=REFUSABLE[path](False)))
                who, msg = await router.recv()
                await router.send(who, Tokens.pack([TokenPart(msg.rid, [5], ["v"],
                                                              {"type": "length"}, {})]))
                ok = await served
                return (resp.status, resp.headers.get("Retry-After"), body, ok.status,
                        ok.headers.get("Retry-After"))
        finally:
            await client.close()
            router.close()
    got, after, body, ok, ok_after = asyncio.run(go())
    assert got == status and after == "7" and message in body["error"]["message"]
    assert ok == 200 and ok_after is None
