"""The API-key guard: which key opens which route, checked before any body is read,
and the caller, user and call each checked request runs as (callers.py,
router_client.py's fair shares)."""
from __future__ import annotations

import hmac
import uuid

from aiohttp import web

from zpd.http.front import FRONT, Front, error_response
from zpd.http.guard import browser
from zpd.http.guard.callers import CALLER, caller_of
from zpd.http.router_client import CALL, USER, http_user

PUBLIC = frozenset({"/health", "/ping"})     # liveness probes send no key
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
