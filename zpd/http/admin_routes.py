"""SGLang's operation routes: pause, continue, weight updates, aborts, memory, health
and server info, each one admin command on the router (which fans it out to every
worker) answered as {"success": bool, "message": str, ...}; a failed command answers
with the status the router or a worker gave it (409 wrong state, 404 unknown rid...)."""
from __future__ import annotations

import asyncio
from collections import Counter

from aiohttp import web

import zpd
from zpd.http.front import FRONT, Front, error_response, json_response, read_body
from zpd.http.records import (BadRequest, GenRequest, boolean, refuse_unknown, stop_strings,
                              string, take, text_field)
from zpd.http.streams import run_all

routes = web.RouteTableDef()

PAUSE_MODES = ("abort", "in_place", "retract")
HEALTH_TIMEOUT_S = 20.0


def failure(reply: dict) -> tuple[int, str]:
    """The status and message of a failed admin reply (from its failed workers' parts)."""
    bad = [w for w in reply.get("workers", []) if not w.get("ok")]
    if not bad:
        return int(reply.get("status") or 500), str(reply.get("error", "failed"))
    text = "; ".join(f"{w.get('role', '?')} {w.get('endpoint', '?')}: {w.get('status', '')} "
                     f"{w.get('error', '')}".rstrip() for w in bad)
    return int(bad[0].get("status") or 500), text


async def admin_answer(front: Front, command: str, done: str, timeout: float | None = None,
                       **args) -> web.Response:
    reply = await front.backend.admin(command, timeout, **args)
    ok = bool(reply.get("ok")) and all(w.get("ok") for w in reply.get("workers", []))
    if ok:
        return json_response({"success": True, "message": done})
    status, message = failure(reply)
    return json_response({"success": False, "message": message}, status)


@routes.post("/pause_generation")
async def pause_generation(request: web.Request) -> web.Response:
    body = await read_body(request, required=False)
    refuse_unknown(body, ("mode",))
    mode = take(body, "mode", string, "abort")
    if mode not in PAUSE_MODES:
        raise BadRequest(f"'mode' must be one of {', '.join(PAUSE_MODES)}, not {mode!r:.40}")
    return await admin_answer(request.app[FRONT], "pause", f"paused ({mode})", mode=mode)


@routes.post("/continue_generation")
async def continue_generation(request: web.Request) -> web.Response:
    refuse_unknown(await read_body(request, required=False), ())
    return await admin_answer(request.app[FRONT], "continue", "continued")


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(request: web.Request) -> web.Response:
    """{"model_path", "weight_version"}; SGLang's other options are taken where zpd
    does the same anyway (load_format auto; the cache and pause are left as they are)."""
    body = await read_body(request)
    refuse_unknown(body, ("model_path", "weight_version", "load_format", "abort_all_requests",
                          "flush_cache", "keep_pause", "is_async", "torch_empty_cache"))
    path = take(body, "model_path", text_field)
    if path is None:
        raise BadRequest("'model_path' is required")
    version = take(body, "weight_version", text_field)
    if take(body, "load_format", string, "auto") != "auto":
        raise BadRequest("'load_format' must be \"auto\" (the format is read from the path)")
    for name in ("flush_cache", "keep_pause", "is_async", "torch_empty_cache"):
        take(body, name, boolean)
    front = request.app[FRONT]
    if take(body, "abort_all_requests", boolean, False):
        await front.backend.admin("abort_all")
    args = {"path": path} | ({"version": version} if version else {})
    return await admin_answer(front, "update_weights", f"weights loaded from {path}",
                              front.weights_timeout, **args)


@routes.get("/get_weight_version")
async def get_weight_version(request: web.Request) -> web.Response:
    workers = await _status_workers(request.app[FRONT])
    versions = Counter(w.get("weight_version") for w in workers)
    return json_response({"weight_version": versions.most_common(1)[0][0] if versions else None,
                          "weight_versions": {w["endpoint"]: w.get("weight_version")
                                              for w in workers}})


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    body = await read_body(request)
    refuse_unknown(body, ("rid", "abort_all"))
    front = request.app[FRONT]
    if take(body, "abort_all", boolean, False):
        return await admin_answer(front, "abort_all", "every request aborted")
    rid = take(body, "rid", text_field)
    if rid is None:
        raise BadRequest("give 'rid' or \"abort_all\": true")
    return await admin_answer(front, "abort", f"request {rid} aborted", rid=rid)


@routes.post("/flush_cache")
async def flush_cache(request: web.Request) -> web.Response:
    refuse_unknown(await read_body(request, required=False), ())
    return await admin_answer(request.app[FRONT], "flush_cache", "cache flushed")


@routes.post("/release_memory_occupation")
async def release_memory_occupation(request: web.Request) -> web.Response:
    await _memory_body(request)
    return await admin_answer(request.app[FRONT], "release_memory", "KV cache memory released")


@routes.post("/resume_memory_occupation")
async def resume_memory_occupation(request: web.Request) -> web.Response:
    await _memory_body(request)
    return await admin_answer(request.app[FRONT], "resume_memory", "KV cache memory resumed")


async def _memory_body(request: web.Request) -> None:
    """SGLang's {"tags": [...]}: zpd releases and resumes the KV pool whatever the tags
    (weights stay in memory)."""
    body = await read_body(request, required=False)
    refuse_unknown(body, ("tags",))
    take(body, "tags", stop_strings)


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """The HTTP server is up (it asks nothing of the router: /health_generate does)."""
    return web.Response(status=200)


@routes.get("/health_generate")
async def health_generate(request: web.Request) -> web.Response:
    """One token through the whole cluster."""
    front = request.app[FRONT]
    probe = GenRequest({"max_new_tokens": 1, "temperature": 0}, input_ids=[0])
    try:
        out, = await asyncio.wait_for(run_all(front.backend, [probe], None), HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(f"no token within {HEALTH_TIMEOUT_S:g} s (paused or overloaded?)",
                              503, "server_error")
    if out.aborted:
        return error_response(f"generation failed: {out.status} {out.finish.get('message')}",
                              503, "server_error")
    return web.Response(status=200)


@routes.get("/get_model_info")
async def get_model_info(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    return json_response({"model_path": front.model, "tokenizer_path": front.model,
                          "is_generation": True, "has_tokenizer": front.tokenizer is not None,
                          "has_chat_template": front.chat is not None})


@routes.get("/get_server_info")
async def get_server_info(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    reply = await front.backend.admin("status")
    workers = reply.get("workers", [])
    return json_response({
        "version": zpd.__version__, "model_path": front.model, "router": front.router,
        "paused": reply.get("paused"), "queued": reply.get("queued"),
        "inflight": reply.get("inflight"), "router_ok": bool(reply.get("ok")),
        "workers": [{k: w.get(k) for k in ("role", "endpoint", "ok", "weight_version", "paused",
                                           "kv_pages", "queues")} for w in workers]})


async def _status_workers(front: Front) -> list[dict]:
    reply = await front.backend.admin("status")
    if not reply.get("ok") and not reply.get("workers"):
        status, message = failure(reply)
        raise BadRequest(f"the router did not answer status: {message}", status, "server_error")
    return [w for w in reply.get("workers", []) if w.get("ok")]
