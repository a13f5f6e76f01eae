"""The HTTP application: the error shape and the route table of both APIs.

Routes translate; they never schedule: each parses its body into GenRequest records
(zpd.http.records), makes its calls on the router client, and formats the answer.
Everything a route needs is on the Front (zpd.http.front), so a unit test builds an
app around a fake backend. Optional parts (the HTTP hardening of zpd/http/guard/)
come in through `Plugs`; this module never imports them."""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from zpd.http import (admin_routes, info_routes, metrics, native, openai_api, responses_api,
                      sync_routes, tokenize_routes)
from zpd.http.front import FRONT, Front, error_response
from zpd.http.records import BadRequest
from zpd.http.router_client import retry_after_header
from zpd.http.streams import Backend

log = logging.getLogger("zpd.http.app")


@dataclass(frozen=True)
class Plugs:
    """What an assembly adds to the core app: middlewares around all the core's
    (`outer`) and between its error shape and the routes (`inner`), a wrapper of the
    router client as the routes see it, and a step run on the new app."""
    outer: tuple = ()
    inner: tuple = ()
    backend: Callable[[Backend], Backend] | None = None
    setup: Callable[[web.Application], None] | None = None


@web.middleware
async def errors(request: web.Request, handler) -> web.StreamResponse:
    """Every error in OpenAI's shape; the server lives on whatever a request did."""
    try:
        return await handler(request)
    except BadRequest as e:
        return error_response(e.message, e.status, e.kind)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        return error_response(f"{e.reason}: {request.method} {request.path}", e.status, kind)
    except (asyncio.CancelledError, ConnectionError):
        raise                                   # the client went away: nobody to answer
    except Exception as e:
        if _client_fault(e):
            log.info("%s %s: bad request: %s: %s", request.method, request.path[:200],
                     type(e).__name__, str(e)[:200])
            return error_response(f"bad request: {type(e).__name__}: {e}", 400)
        log.exception("%s %s failed", request.method, request.path[:200])
        return error_response(f"internal error: {type(e).__name__}", 500, "server_error")


def _client_fault(e: Exception) -> bool:
    """Whether `e` is what a malformed request makes aiohttp raise (a broken body or
    chunked encoding): the client's fault, worth one line and no traceback."""
    return isinstance(e, (HttpProcessingError, RequestPayloadError, UnicodeDecodeError))


def build_app(front: Front, max_body_bytes: int | None = None,
              plugs: Plugs = Plugs()) -> web.Application:
    """The app around `front`, with `plugs` in; bodies are inflated by the routes (after
    any key check of an inner plug)."""
    if max_body_bytes is not None:
        front.max_body_bytes = max_body_bytes
    app = web.Application(middlewares=[*plugs.outer, retry_after_header, errors, *plugs.inner],
                          client_max_size=front.max_body_bytes)
    if plugs.setup is not None:
        plugs.setup(app)
    # latencies for /metrics, summed over the fronts of `zpd http --workers N`
    front.backend = metrics.metered(front.backend, front.model, front.config.metrics_dir)
    if front.backend.metrics.shared is not None:
        app.cleanup_ctx.append(front.backend.metrics.shared.running)
    if plugs.backend is not None:
        front.backend.inner = plugs.backend(front.backend.inner)
    app[FRONT] = front
    for module in (native, admin_routes, info_routes, sync_routes, openai_api, responses_api,
                   metrics, tokenize_routes):
        app.add_routes(module.routes)
    return app
