"""What every route shares: the Front (the router client, the model's text handling,
the keys), and answering JSON or an error in OpenAI's shape."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

import orjson
from aiohttp import web

from engines.formats.chat import ChatTemplate
from engines.formats.tokenizer import Tokenizer
from zpd.config import HttpConfig
from zpd.http import body
from zpd.http.records import BadRequest, error_body, json_object
from zpd.http.sglang_fields import UnknownFields
from zpd.http.streams import Backend, EventStream, StreamBudget
from zpd.http.tool_calls import default_parser


@dataclass
class Front:
    """Everything the routes share: the router, the model's text handling, the keys."""
    backend: Backend
    model: str                           # the id clients see (--served-model-name, else --model)
    tokenizer: Tokenizer | None = None
    chat: ChatTemplate | None = None
    text_problem: str = ""               # why text or chat requests cannot be served
    api_key: str | None = None
    admin_api_key: str | None = None
    router: str = ""
    weights_timeout: float = 600.0       # seconds update_weights_from_disk may take
    unknown_fields: UnknownFields = field(default_factory=UnknownFields)   # warned once each
    model_path: str = ""                 # --model (default: `model`)
    tokenizer_path: str = ""             # --tokenizer-path (default: model_path)
    max_body_bytes: int = 64 << 20       # a body larger than this, raw or inflated: 413
    body_timeout: float = 60.0           # seconds a body may take to arrive (408)
    # without api_key: the host names served besides addresses and localhost (guard/browser.py)
    allowed_hosts: frozenset[str] = frozenset()
    config: HttpConfig = field(default_factory=HttpConfig)   # caps and streaming of the routes
    streams: StreamBudget | None = None  # what all streams hold unsent (default: from config)
    # whether this request's caller may see addresses (the guard's callers.py decides;
    # without it there are no keys, so no caller to hide them from)
    sees_internals: Callable[[], bool] = field(default=lambda: True)

    def __post_init__(self) -> None:
        if self.streams is None:
            self.streams = StreamBudget(self.config.stream_buffer_total_bytes)

    def event_stream(self, request: web.Request) -> EventStream:
        """An SSE answer to `request`, bounded as the config says."""
        cfg = self.config
        return EventStream(request, cfg.stream_write_timeout, cfg.stream_buffer_bytes, self.streams)

    @property
    def tool_parser(self) -> str | None:
        """How tool calls are written: --tool-call-parser, else what the template shows."""
        return self.config.tool_call_parser or default_parser(
            self.chat.source if self.chat is not None else None)

    def needs_text(self, what: str) -> None:
        """BadRequest unless the model has a tokenizer (to show `what` as text)."""
        if self.tokenizer is None:
            raise BadRequest(f"{self.text_problem or 'the model has no tokenizer'}: {what} "
                             "needs one")


FRONT = web.AppKey("front", Front)


def json_response(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


async def json_answer(build: Callable[[], object]) -> web.Response:
    """`build()`'s object as a JSON answer, built and serialized off the event loop: a
    big call's answer (an 80 MB one took seconds to format) must not hold every other
    caller's requests meanwhile."""
    body = await asyncio.to_thread(lambda: orjson.dumps(build()))
    return web.Response(body=body, content_type="application/json")


def error_response(message: str, status: int, kind: str = "invalid_request_error") -> web.Response:
    return json_response(error_body(message, status, kind), status)


async def read_body(request: web.Request, required: bool = True) -> dict:
    """The request's JSON object; BadRequest when it is not one ({} for an empty body
    where none is `required`), or is too large, too slow or wrongly encoded (body.py)."""
    front = request.app[FRONT]
    return json_object(await body.read(request, front.max_body_bytes, front.body_timeout),
                       required)
