"""SGLang's operation routes: pause, continue, weight updates and versions, aborts,
the cache and memory, each one admin command on the router (which fans it out to every
worker) answered as {"success": bool, "message": str, ...}; a failed command answers
with the status the router or a worker gave it (409 wrong state...). Where SGLang serves
a route for GET and POST (/flush_cache, the memory routes), so does zpd: slime and
verl call GET /flush_cache. Health, server info and loads: zpd/http/info_routes.py."""
from __future__ import annotations

from collections import Counter
from typing import Any, Mapping

from aiohttp import web

from zpd.http.front import FRONT, Front, json_response, read_body
from zpd.http.records import BadRequest, boolean, stop_strings, string, take
from zpd.wire.admin import (AbortAll, AbortRequest, AdminCommand, Continue, FlushCache, GetWeights, Pause, ReleaseMemory, ResumeMemory, Status, UpdateWeights, UpdateWeightVersion, parse)
from zpd.wire.admin_fields import MEMORY_TAGS, BadArgs

routes = web.RouteTableDef()

NOT_FOUND = 404


def command(cls: type[AdminCommand], renamed: Mapping[str, str] | None = None,
            **fields: Any) -> AdminCommand:
    """The record of `cls` from a body's `fields` (null: absent), checked by the record;
    its 400 names the body's fields (`renamed`: wire name -> the body's)."""
    try:
        return parse(cls.COMMAND, {k: v for k, v in fields.items() if v is not None}, client=True)
    except BadArgs as e:
        message = str(e)
        for wire, body_name in (renamed or {}).items():
            message = message.replace(repr(wire), repr(body_name))
        raise BadRequest(message) from None


def ignore_unknown(request: web.Request, body: dict, known: tuple[str, ...]) -> None:
    """Names the route does not know are dropped and logged once each, as on /generate
    and as SGLang's bodies drop them (AReaL's older `abort_all_request`, say)."""
    unknown = sorted((str(k) for k in set(body) - set(known)), key=str)
    request.app[FRONT].unknown_fields.note(unknown, request.path)


async def send(front: Front, cmd: AdminCommand, timeout: float | None = None) -> dict:
    """One admin command on the router; its reply."""
    return await front.backend.admin(cmd.COMMAND, timeout, **cmd.args())


def failure(reply: dict) -> tuple[int, str]:
    """The status and message of a failed admin reply (from its failed workers' parts)."""
    bad = [w for w in reply.get("workers", []) if not w.get("ok")]
    if not bad:
        return int(reply.get("status") or 500), str(reply.get("error", "failed"))
    text = "; ".join(f"{w.get('role', '?')} {w.get('endpoint', '?')}: {w.get('status', '')} "
                     f"{w.get('error', '')}".rstrip() for w in bad)
    return int(bad[0].get("status") or 500), text


async def admin_answer(front: Front, cmd: AdminCommand, done: str,
                       timeout: float | None = None) -> web.Response:
    reply = await send(front, cmd, timeout)
    if _all_ok(reply):
        return json_response({"success": True, "message": done})
    status, message = failure(reply)
    return json_response({"success": False, "message": message}, status)


@routes.post("/pause_generation")
async def pause_generation(request: web.Request) -> web.Response:
    body = await read_body(request, required=False)
    ignore_unknown(request, body, ("mode",))
    cmd = command(Pause, mode="abort" if body.get("mode") is None else body["mode"])
    return await admin_answer(request.app[FRONT], cmd, f"paused ({cmd.mode})")


@routes.post("/continue_generation")
async def continue_generation(request: web.Request) -> web.Response:
    ignore_unknown(request, await read_body(request, required=False), ())
    return await admin_answer(request.app[FRONT], Continue(), "continued")


@routes.post("/update_weights_from_disk")
async def update_weights_from_disk(request: web.Request) -> web.Response:
    """{"model_path", "weight_version"}; SGLang's other options are taken where zpd
    does the same anyway (load_format auto; the cache and pause are left as they are).
    Without a weight_version the version stays what it was (SGLang's way)."""
    body = await read_body(request)
    ignore_unknown(request, body, ("model_path", "weight_version", "load_format",
                                  "abort_all_requests", "flush_cache", "keep_pause", "is_async",
                                  "torch_empty_cache"))
    cmd = command(UpdateWeights, {"path": "model_path"}, path=body.get("model_path"),
                  weight_version=body.get("weight_version"))
    if take(body, "load_format", string, "auto") != "auto":
        raise BadRequest("'load_format' must be \"auto\" (the format is read from the path)")
    for name in ("flush_cache", "keep_pause", "is_async", "torch_empty_cache"):
        take(body, name, boolean)
    front = request.app[FRONT]
    await abort_all_first(front, body)
    return await admin_answer(front, cmd, f"weights loaded from {cmd.path}", front.weights_timeout)


@routes.get("/get_weight_version")
async def get_weight_version(request: web.Request) -> web.Response:
    workers = await status_workers(request.app[FRONT])
    versions = Counter(w.get("weight_version") for w in workers)
    return json_response({"weight_version": versions.most_common(1)[0][0] if versions else None,
                          "weight_versions": {w["endpoint"]: w.get("weight_version")
                                              for w in workers}})


@routes.get("/get_weights_by_name")
@routes.post("/get_weights_by_name")
async def get_weights_by_name(request: web.Request) -> web.Response:
    """SGLang's {"name", "truncate_size" (100)}: the weight's first truncate_size rows
    as float32 values in nested lists (a 1-D weight: a flat list), the JSON body itself,
    from the first worker of the router's status (every worker serves the same ones)."""
    body = await read_body(request, required=False) or dict(request.query)   # GET ?name=
    if isinstance(body.get("truncate_size"), str) and body["truncate_size"].isdigit():
        body["truncate_size"] = int(body["truncate_size"])
    ignore_unknown(request, body, ("name", "truncate_size"))
    cmd = command(GetWeights, name=body.get("name"), truncate_size=body.get("truncate_size"))
    reply = await send(request.app[FRONT], cmd)
    workers = reply.get("workers", [])
    if _all_ok(reply) and workers:
        return json_response(workers[0]["values"])
    status, message = failure(reply)
    raise BadRequest(message, status)


@routes.post("/update_weight_version")
async def update_weight_version(request: web.Request) -> web.Response:
    """SGLang's {"new_version", "abort_all_requests"}: every worker reports `new_version`
    for the tokens it makes from now on; the weights stay as they are."""
    body = await read_body(request)
    ignore_unknown(request, body, ("new_version", "abort_all_requests"))
    cmd = command(UpdateWeightVersion, {"weight_version": "new_version"},
                  weight_version=body.get("new_version"))
    version = cmd.weight_version
    front = request.app[FRONT]
    await abort_all_first(front, body)
    reply = await send(front, cmd)
    if _all_ok(reply):
        return json_response({"success": True, "message": f"Weight version updated to {version}",
                              "new_version": version})
    status, message = failure(reply)
    return json_response({"success": False, "message": message}, status)


@routes.post("/abort_request")
async def abort_request(request: web.Request) -> web.Response:
    """200 for a rid that is running (aborted), finished or unknown, as SGLang answers:
    a client that aborts a request which just finished has nothing to handle."""
    body = await read_body(request)
    ignore_unknown(request, body, ("rid", "abort_all"))
    front = request.app[FRONT]
    if take(body, "abort_all", boolean, False):
        return await admin_answer(front, AbortAll(), "every request aborted")
    if body.get("rid") is None:
        raise BadRequest("give 'rid' or \"abort_all\": true")
    rid = command(AbortRequest, rid=body["rid"]).rid
    reply = await send(front, AbortRequest(rid))
    if _all_ok(reply):
        return json_response({"success": True, "message": f"request {rid} aborted"})
    status, message = failure(reply)
    if status == NOT_FOUND:
        return json_response({"success": True, "message": f"request {rid} is not running "
                                                          "(finished or unknown): nothing to abort"})
    return json_response({"success": False, "message": message}, status)


@routes.get("/flush_cache")
@routes.post("/flush_cache")
async def flush_cache(request: web.Request) -> web.Response:
    """GET or POST, answered as SGLang does: 200 with a line of text once flushed, 400
    with the reason when it was not (requests running); slime retries until 200."""
    ignore_unknown(request, await read_body(request, required=False), ())
    reply = await send(request.app[FRONT], FlushCache())
    if _all_ok(reply):
        return web.Response(text="Cache flushed.\n", status=200)
    return web.Response(text=f"Cache not flushed: {failure(reply)[1]}\n", status=400)


@routes.get("/release_memory_occupation")
@routes.post("/release_memory_occupation")
async def release_memory_occupation(request: web.Request) -> web.Response:
    cmd = await _memory_command(request, ReleaseMemory)
    return await admin_answer(request.app[FRONT], cmd,
                              f"memory released ({', '.join(cmd.tags or MEMORY_TAGS)})")


@routes.get("/resume_memory_occupation")
@routes.post("/resume_memory_occupation")
async def resume_memory_occupation(request: web.Request) -> web.Response:
    cmd = await _memory_command(request, ResumeMemory)
    return await admin_answer(request.app[FRONT], cmd,
                              f"memory resumed ({', '.join(cmd.tags or MEMORY_TAGS)})")


async def _memory_command(request: web.Request, cls: type[AdminCommand]) -> AdminCommand:
    """SGLang's {"tags": [...]} (absent, null or empty: every tag): "kv_cache" is the KV
    pool, "weights" the model's weights (restored bit for bit on resume from a host copy
    or a private spill file, zpd/worker/memory.py), "cuda_graph" has nothing to release.
    A single tag may come as a string."""
    body = await read_body(request, required=False)
    ignore_unknown(request, body, ("tags",))
    return command(cls, tags=take(body, "tags", stop_strings) or None)


async def abort_all_first(front: Front, body: dict) -> None:
    """SGLang's `abort_all_requests`: end every request before the command."""
    if take(body, "abort_all_requests", boolean, False):
        await send(front, AbortAll())


def _all_ok(reply: dict) -> bool:
    return bool(reply.get("ok")) and all(w.get("ok") for w in reply.get("workers", []))


async def status_workers(front: Front) -> list[dict]:
    """The live workers of the router's status, in its order; BadRequest (its status)
    when the router did not answer."""
    reply = await send(front, Status())
    if not reply.get("ok") and not reply.get("workers"):
        status, message = failure(reply)
        raise BadRequest(f"the router did not answer status: {message}", status, "server_error")
    return [w for w in reply.get("workers", []) if w.get("ok")]
