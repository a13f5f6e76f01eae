"""The HTTP application: the API-key guard, the error shape, and the route table of
both APIs.

Routes translate; they never schedule: each parses its body into GenRequest records
(zpd.http.records), makes its calls on the router client, and formats the answer.
Everything a route needs is on the Front (zpd.http.front), so a unit test builds an
app around a fake backend."""
from __future__ import annotations

import asyncio
import hmac
import logging
import uuid

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from zpd.http import (admin_routes, browser, info_routes, metrics, native, openai_api,
                      sync_routes)
from zpd.http.callers import CALLER, CallerBackend, caller_of
from zpd.http.connections import BOOK, ConnectionLimits, Connections, tracking
from zpd.http.front import FRONT, Front, error_response
from zpd.http.records import BadRequest
from zpd.http.router_client import CALL, USER, http_user, retry_after_header

log = logging.getLogger("zpd.http.app")

PUBLIC = frozenset({"/health"})
# Routes that change what every user sees: the admin key guards them when it is set.
ADMIN = frozenset({"/pause_generation", "/continue_generation", "/update_weights_from_disk",
                   "/update_weight_version",
                   "/abort_request", "/flush_cache", "/release_memory_occupation",
                   "/resume_memory_occupation", "/init_weights_update_group",
                   "/update_weights_from_distributed", "/destroy_weights_update_group",
                   "/update_weights_from_tensor", "/cancel_weight_update"})


def keys_for(front: Front, path: str) -> tuple[str, ...]:
    """The keys any one of which opens `path`; none: it is open to all. The admin key
    opens every route the API key opens."""
    if path in PUBLIC:
        return ()
    if path in ADMIN and front.admin_api_key:
        return (front.admin_api_key,)
    if not front.api_key:
        return ()
    return tuple(k for k in (front.api_key, front.admin_api_key) if k)


def _route_path(request: web.Request) -> str:
    """The path of the route that will answer (not the path as spelled, which may be
    encoded differently), so the keys checked are always that route's."""
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def _presented(request: web.Request) -> bytes:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else b""


@web.middleware
async def guard(request: web.Request, handler) -> web.StreamResponse:
    front = request.app[FRONT]
    path = _route_path(request)
    keys = keys_for(front, path)
    token = _presented(request)
    # every key is compared, so the time taken does not tell which one came close
    if keys and not sum(hmac.compare_digest(token, k.encode()) for k in keys):
        which = "admin API key" if path in ADMIN and front.admin_api_key else "API key"
        return error_response(f"missing or wrong {which}: send 'Authorization: Bearer KEY'",
                              401, "authentication_error")
    if not front.api_key:
        browser.check(request, front.allowed_hosts)        # a web page has no key to send
    CALLER.set(caller_of(token, front.api_key, front.admin_api_key))
    USER.set(http_user(request.remote, token, bool(front.api_key or front.admin_api_key)))
    CALL.set(uuid.uuid4().hex[:16])       # its requests take turns with its caller's others
    return await handler(request)


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
              limits: ConnectionLimits = ConnectionLimits()) -> web.Application:
    """The app around `front`, to serve with `server_options(limits)` on a WatchedSite
    (zpd/http/connections.py): bodies are inflated by the routes, after the key check."""
    if max_body_bytes is not None:
        front.max_body_bytes = max_body_bytes
    app = web.Application(middlewares=[tracking, retry_after_header, errors, guard],
                          client_max_size=front.max_body_bytes)
    app[BOOK] = Connections(limits)
    # latencies for /metrics, summed over the fronts of `zpd http --workers N`
    front.backend = metrics.metered(front.backend, front.model, front.config.metrics_dir)
    if front.backend.metrics.shared is not None:
        app.cleanup_ctx.append(front.backend.metrics.shared.running)
    if not isinstance(front.backend.inner, CallerBackend):
        front.backend.inner = CallerBackend(front.backend.inner, front.router)
    app[FRONT] = front
    for module in (native, admin_routes, info_routes, sync_routes, openai_api, metrics):
        app.add_routes(module.routes)
    return app
