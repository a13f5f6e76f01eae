"""The HTTP front against slow, idle, compressed and browser-borne requests, and what
one caller may learn of another (issue 30, items 6, 8 and 10): over real sockets
where the connection matters, over aiohttp's test client elsewhere."""
from __future__ import annotations

import asyncio
import gzip
import logging
import socket
import zlib
from contextlib import asynccontextmanager

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from tests.unit.http_fake import FakeBackend, FrontServer, call, front, tiny_answer
from zpd.http.guard.plug import guarded_app
from zpd.http.guard.browser import allowed_hosts
from zpd.http.guard.connections import BOOK, ConnectionLimits, WatchedSite, server_options
from zpd.http.router_client import abort_chunk

JSON = {"Content-Type": "application/json"}
BOUND_S = 10.0                     # generous: what "closed within the bound" may take here


@asynccontextmanager
async def serving(f, limits: ConnectionLimits):
    """`f` served on a free loopback port as `zpd http` serves it: (base URL, book)."""
    app = guarded_app(f, limits=limits)
    runner = web.AppRunner(app, **server_options(limits))
    await runner.setup()
    site = WatchedSite(runner, "127.0.0.1", 0, app[BOOK])
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}", app[BOOK], port
    finally:
        await runner.cleanup()


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sent until it closed the connection (within BOUND_S)."""
    return await asyncio.wait_for(reader.read(), BOUND_S)


async def generate(base: str, session: aiohttp.ClientSession) -> int:
    async with session.post(base + "/generate", json={"input_ids": [1]}) as r:
        await r.read()
        return r.status


# --- item 6: slow and idle connections -------------------------------------------------

def test_slow_headers_are_closed_and_real_requests_served_meanwhile():
    async def go():
        async with serving(front(), ConnectionLimits(keepalive=30, header=0.5)) as (base, _, port):
            slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(30)]
            for _, w in slow:
                w.write(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")   # never ends
            async with aiohttp.ClientSession() as s:
                assert await generate(base, s) == 200
            for r, w in slow:
                assert await closed_by_server(r) == b""
                w.close()
    asyncio.run(go())


def test_idle_connections_close_after_the_keepalive():
    async def go():
        async with serving(front(), ConnectionLimits(keepalive=0.3, header=5)) as (_, book, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = await closed_by_server(r)
            assert answer.startswith(b"HTTP/1.1 200") and not book.open
            w.close()
    asyncio.run(go())


def test_past_the_cap_the_longest_idle_connection_makes_room():
    async def go():
        limits = ConnectionLimits(keepalive=60, header=60, max_connections=8)
        async with serving(front(), limits) as (base, book, port):
            slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
            for _, w in slow:
                w.write(b"GET /health HTTP/1.1\r\n")
                await w.drain()
            async with aiohttp.ClientSession() as s:
                for _ in range(3):
                    assert await generate(base, s) == 200
            assert len(book.open) <= 8 and book.closed["over the cap"] >= 12
            assert await closed_by_server(slow[0][0]) == b""       # the oldest went first
            for _, w in slow:
                w.close()
    asyncio.run(go())


def test_a_body_that_never_ends_gets_408():
    async def go():
        f = front()
        f.body_timeout = 0.3
        async with serving(f, ConnectionLimits(keepalive=30, header=30)) as (base, _, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/"
                    b"json\r\nContent-Length: 100\r\n\r\n{\"input_ids\"")
            head = await asyncio.wait_for(r.readline(), BOUND_S)
            assert head.startswith(b"HTTP/1.1 408"), head
            w.close()
            async with aiohttp.ClientSession() as s:
                assert await generate(base, s) == 200
    asyncio.run(go())


# --- item 6 and 10: compressed bodies ---------------------------------------------------

def test_a_gzip_bomb_is_refused_without_inflating_it_whole():
    bomb = gzip.compress(b" " * (32 << 20), 9)            # 32 MiB of spaces, ~32 KB
    assert len(bomb) < 1 << 16                             # the raw body fits the cap
    status, body = call(front(), "POST", "/generate", raw=bomb,
                        headers=JSON | {"Content-Encoding": "gzip"})
    assert status == 413 and "inflated" in body["error"]["message"], body


def test_a_compressed_body_is_not_inflated_before_the_key_is_checked(monkeypatch):
    """aiohttp inflated a body as it arrived, before any route or key: each 509 KB bomb
    stalled the front 1.2 s, even answered 401."""
    from aiohttp import http_parser
    made = []
    real = http_parser.DeflateBuffer.__init__
    monkeypatch.setattr(http_parser.DeflateBuffer, "__init__",
                        lambda self, *a, **k: made.append(1) or real(self, *a, **k))
    bomb = gzip.compress(b" " * (8 << 20), 9)
    status, _ = call(front(api_key="k"), "POST", "/generate", raw=bomb,
                     headers=JSON | {"Content-Encoding": "gzip", "Authorization": "Bearer no"})
    assert status == 401 and not made
    ok = gzip.compress(b'{"input_ids": [1]}')
    assert call(front(), "POST", "/generate", raw=ok,
                headers=JSON | {"Content-Encoding": "gzip"})[0] == 200
    assert call(front(), "POST", "/generate", raw=zlib.compress(b'{"input_ids": [1]}'),
                headers=JSON | {"Content-Encoding": "deflate"})[0] == 200


@pytest.mark.parametrize("coding, raw, status", [
    ("gzip", b"this is not gzip", 400),
    ("gzip", gzip.compress(b'{"input_ids": [1]}')[:-12], 400),            # cut short
    ("gzip", gzip.compress(b'{"input_ids": [1]}') + b"tail", 400),
    ("deflate", b"\x00\x01\x02", 400),
    ("br", b"{}", 415),
    ("zstd", b"{}", 415),
    ("gzip, gzip", b"{}", 415),
    ("nonsense", b"{}", 415),
])
def test_bad_content_encoding_is_a_4xx_logged_without_traceback(coding, raw, status, caplog):
    caplog.set_level(logging.DEBUG)
    f = front()
    got, body = call(f, "POST", "/generate", raw=raw, headers=JSON | {"Content-Encoding": coding})
    assert got == status, body
    assert not [r for r in caplog.records if r.exc_info], "a client's bad body logged a traceback"
    assert call(f, "POST", "/generate", {"input_ids": [1]})[0] == 200


# --- item 8: a web page may not drive a keyless front ----------------------------------

@pytest.mark.parametrize("headers, status", [
    ({"Host": "attacker.example:30000"}, 403),                     # DNS rebinding
    ({"Origin": "http://attacker.example"}, 403),                  # CSRF from a page
    ({"Origin": "null"}, 403),
    ({"Sec-Fetch-Site": "cross-site"}, 403),                        # an <img> or a form GET
    ({"Content-Type": "text/plain"}, 415),                          # a form may send these
    ({"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ({"Content-Type": "multipart/form-data; boundary=x"}, 415),
    ({"Host": "localhost:30000"}, 200),
    ({"Host": "[::1]:30000"}, 200),
    ({"Host": "10.1.2.3"}, 200),
    ({"Origin": "http://{host}"}, 200),                             # the front's own page
    ({"Sec-Fetch-Site": "same-origin"}, 200),
    ({"Content-Type": "application/json; charset=utf-8"}, 200),
    ({"Content-Type": "application/vnd.api+json"}, 200),
])
def test_keyless_front_refuses_what_only_a_browser_sends(headers, status):
    async def go(f, key: str | None = None):
        async with TestClient(FrontServer(guarded_app(f))) as c:
            host = f"{c.host}:{c.port}"
            sent = JSON | {k: v.replace("{host}", host) for k, v in headers.items()}
            sent |= {"Authorization": f"Bearer {key}"} if key else {}
            answers = []
            for path, data in (("/pause_generation", b"{}"), ("/generate", b'{"input_ids": [1]}')):
                async with c.post(path, data=data, headers=sent) as r:
                    answers.append(r.status)
            return answers
    assert asyncio.run(go(front())) == [status, status]
    # a page cannot send a key: with one, none of this is refused
    assert asyncio.run(go(front(api_key="k"), "k")) == [200, 200]


def test_a_page_from_another_port_of_an_allowed_host_is_another_site():
    """The names the front answers to (its bound host, this machine's name) are every
    local web server's too: a notebook's page at 127.0.0.1:8888 must not drive it."""
    async def go(origin: str) -> int:
        f = front()
        f.allowed_hosts = allowed_hosts("127.0.0.1", ("zpd.internal",))
        async with TestClient(FrontServer(guarded_app(f))) as c:
            sent = JSON | {"Origin": origin.replace("{host}", f"{c.host}:{c.port}")}
            async with c.post("/pause_generation", data=b"{}", headers=sent) as r:
                return r.status
    for origin in ("http://127.0.0.1:8888", f"http://{socket.gethostname()}:8888",
                   "http://zpd.internal:8888", "http://zpd.internal"):
        assert asyncio.run(go(origin)) == 403, origin
    assert asyncio.run(go("http://{host}")) == 200


def test_allowed_hosts_name_further_hosts():
    f = front()
    f.allowed_hosts = frozenset({"zpd.internal"})
    assert call(f, "GET", "/get_model_info", headers={"Host": "zpd.internal:30000"})[0] == 200
    assert call(f, "GET", "/get_model_info", headers={"Host": "other.internal"})[0] == 403
    f.allowed_hosts = frozenset({"*"})
    assert call(f, "GET", "/get_model_info", headers={"Host": "other.internal"})[0] == 200


# --- item 8: user-key holders do not see where the cluster listens ---------------------

STATUS = {"ok": True, "paused": None, "queued": 0, "inflight": 0, "workers": [
    {"ok": True, "role": "prefill", "endpoint": "10.9.8.7:4101", "weight_version": "v1",
     "links": [{"endpoint": "10.9.8.6:4102", "state": "up"}]},
    {"ok": True, "role": "decode", "endpoint": "10.9.8.6:4102", "weight_version": "v1"}]}


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info", "/get_weight_version",
                                  "/metrics"])
def test_user_key_holders_see_no_addresses_admin_key_holders_do(path):
    f = front(FakeBackend(replies={"status": STATUS}), api_key="user", admin_api_key="admin",
              router="10.9.8.5:5757")
    status, seen = call(f, "GET", path, headers={"Authorization": "Bearer user"}, read="text")
    assert status == 200
    for address in ("10.9.8.7", "10.9.8.6", "10.9.8.5", "4101", "4102", "5757"):
        assert address not in str(seen), (address, seen)
    status, seen = call(f, "GET", path, headers={"Authorization": "Bearer admin"})
    assert status == 200 and "10.9.8.6:4102" in str(seen)


# --- item 10: a rid in flight for one caller tells another nothing ---------------------

class GlobalRids(FakeBackend):
    """The router's rule: a rid in flight from anyone is refused with 409."""

    def __init__(self) -> None:
        super().__init__(lambda req, rid: tiny_answer(req, rid, [72, 105]), block_after=1)
        self.live: set[str] = set()

    def open(self, req, sink):
        if req.rid in self.live:
            sink(abort_chunk(req.rid, 409, f"rid {req.rid!r} is already in flight"))
            return lambda: None
        self.live.add(req.rid)
        close = super().open(req, sink)
        return lambda: (self.live.discard(req.rid), close())


def test_another_callers_rid_is_neither_refused_nor_named():
    async def go():
        f = front(GlobalRids(), api_key="user", admin_api_key="admin")
        async with TestClient(FrontServer(guarded_app(f))) as c:
            body = {"input_ids": [1], "rid": "mine", "stream": True}
            first = await c.post("/generate", json=body, headers={"Authorization": "Bearer admin"})
            await first.content.readuntil(b"\n\n")                  # in flight, blocked
            second = await c.post("/generate", json=body, headers={"Authorization": "Bearer user"})
            event = await second.content.readuntil(b"\n\n")
            assert second.status == 200 and b"409" not in event and b'"mine"' in event, event
            spaces = [r.rid.partition(":")[0] for r in f.backend.requests]
            assert [r.rid.partition(":")[2] for r in f.backend.requests] == ["mine", "mine"]
            assert spaces[0].startswith("admin.") and spaces[1].startswith("user.")
            same = await c.post("/generate", json=body, headers={"Authorization": "Bearer user"})
            text = await same.text()                 # the caller's own rid: its own 409
            assert '"status_code":409' in text and "'mine'" in text and "user." not in text, text
            async with c.post("/abort_request", json={"rid": "mine"},
                              headers={"Authorization": "Bearer admin"}) as r:
                assert r.status == 200
            aborted = sorted(a["rid"] for c_, a in f.backend.admins if c_ == "abort")
            assert aborted == [f"{spaces[0]}:mine", f"{spaces[1]}:mine"]
            first.close()
            second.close()
    asyncio.run(go())


def test_an_abort_names_no_address_to_a_user_key_holder():
    lost = {"type": "abort", "status_code": 503, "message": "decode 10.9.8.6:4102 is unavailable"}
    f = front(FakeBackend(lambda req, rid: tiny_answer(req, rid, [72], lost),
                          replies={"status": STATUS}), api_key="user", admin_api_key="admin")
    status, body = call(f, "POST", "/generate", {"input_ids": [1]},
                        headers={"Authorization": "Bearer user"})
    message = body["meta_info"]["finish_reason"]["message"]
    assert status == 200 and "10.9.8.6" not in message and "unavailable" in message, message
    status, body = call(f, "POST", "/generate", {"input_ids": [1]},
                        headers={"Authorization": "Bearer admin"})
    assert "10.9.8.6:4102" in body["meta_info"]["finish_reason"]["message"]
