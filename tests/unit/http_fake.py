"""A fake router for the HTTP front's unit tests: each request's chunks come from a
script, as the router client would yield them; calls go through aiohttp's test
client, each in its own event loop."""
from __future__ import annotations

import asyncio
from typing import Any, Callable

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from engines.models.tiny import tiny_tokenizer
from zpd.http.guard.plug import guarded_app
from zpd.http.guard.connections import ConnectionLimits, server_options
from zpd.http.front import Front
from zpd.http.records import GenRequest


class FrontServer(TestServer):
    """aiohttp's test server, run with the settings `zpd http` runs with (bodies are
    inflated by the routes, after the key check)."""

    async def _make_runner(self, **kwargs: Any) -> web.AppRunner:
        return web.AppRunner(self.app, **(kwargs | server_options(ConnectionLimits())))


def chunk(rid: str, ids: list[int], finish: dict | None = None, meta: dict | None = None,
          text: str | None = None, version: str = "v1", **extra: Any) -> dict:
    """A chunk as zpd.Client.stream yields it (with logprob fields when given)."""
    c = {"rid": rid, "token_ids": ids, "weight_versions": [version] * len(ids),
         "finished": finish is not None} | extra
    if finish is not None:
        c |= {"finish_reason": finish, "meta": meta or {}, "text": text}
    return c


def tiny_answer(req: GenRequest, rid: str, ids: list[int], finish: dict | None = None,
                per_chunk: int = 1, **final: Any) -> list[dict]:
    """`ids` as chunks of `per_chunk` tokens, the last finished (length unless `finish`),
    with the text the workers would send (the tiny tokenizer's)."""
    text = tiny_tokenizer().decode(ids)
    parts = [ids[i:i + per_chunk] for i in range(0, len(ids), per_chunk)] or [[]]
    prompt = len(req.input_ids or ()) or 3
    meta = {"prompt_tokens": prompt, "completion_tokens": len(ids), "retractions": 0}
    return [chunk(rid, p) for p in parts[:-1]] + [
        chunk(rid, parts[-1], finish or {"type": "length"}, meta, text) | final]


class FakeBackend:
    """Answers each request with `script(req, rid)`'s chunks; records what it saw."""

    def __init__(self, script: Callable[[GenRequest, str], list[dict]] | None = None,
                 replies: dict[str, dict] | None = None, block_after: int | None = None) -> None:
        self.script = script or (lambda req, rid: tiny_answer(req, rid, [72, 105, 33]))
        self.replies = replies or {}
        self.block_after = block_after       # chunks, then wait forever (disconnect tests)
        self.requests: list[GenRequest] = []
        self.admins: list[tuple[str, dict]] = []
        self.closed: list[str] = []          # rids whose stream was closed before the end
        self.n = 0

    def open(self, req: GenRequest, sink: Callable[[dict], None]) -> Callable[[], None]:
        """The router client's interface: the script's chunks go to `sink`, one per
        turn of the loop; `close()` before the end records the rid in `closed`."""
        self.requests.append(req)
        rid, self.n = req.rid or f"r{self.n}", self.n + 1
        finished = False

        async def feed() -> None:
            nonlocal finished
            for i, c in enumerate(self.script(req, rid)):
                if self.block_after is not None and i >= self.block_after:
                    await asyncio.Event().wait()
                await asyncio.sleep(0)
                finished = c["finished"]
                sink(c)
        task = asyncio.ensure_future(feed())

        def close() -> None:
            task.cancel()
            if not finished and rid not in self.closed:
                self.closed.append(rid)
        return close

    async def admin(self, command: str, timeout: float | None = None, **args) -> dict:
        self.admins.append((command, args))
        return self.replies.get(command, {"ok": True, "workers": [
            {"ok": True, "role": "decode", "endpoint": "d:1", "weight_version": "v1"}]})


def front(backend: FakeBackend | None = None, **kw: Any) -> Front:
    return Front(backend or FakeBackend(), "tiny", tiny_tokenizer(), None,
                 "the tiny model has no chat template", **kw)


def call(f: Front, method: str, path: str, body: Any = None, raw: bytes | None = None,
         headers: dict | None = None, read: str = "json") -> tuple[int, Any]:
    """(status, JSON body or SSE events or text) of one request to an app around `f`."""
    async def go():
        async with TestClient(FrontServer(guarded_app(f, max_body_bytes=1 << 16))) as client:
            kw = {"data": raw} if raw is not None else ({"json": body} if body is not None else {})
            sent = headers
            if raw is not None:      # as SGLang's and OpenAI's clients send bodies
                sent = {"Content-Type": "application/json"} | (headers or {})
            resp = await client.request(method, path, headers=sent, **kw)
            text = await resp.text()
            return resp.status, text, resp.headers.get("Content-Type", "")
    status, text, kind = asyncio.run(go())
    if kind.startswith("text/event-stream"):
        return status, sse_events(text)
    if kind.startswith("application/json"):
        import orjson
        return status, orjson.loads(text)
    return status, text


def sse_events(text: str) -> list:
    """The events of an SSE body (their data; an `event:` line before it is left out):
    JSON objects, then the string "[DONE]"."""
    import orjson
    out = []
    for block in text.split("\n\n"):
        block = block.split("\n")[-1] if block.startswith("event: ") else block
        if block.startswith("data: "):
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else orjson.loads(data))
    return out
