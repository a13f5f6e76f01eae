"""SGLang's trainer weight-sync routes, each one admin command on the router
(zpd/router/weight_sync.py says what the router and workers do):
`init_weights_update_group`, `update_weights_from_distributed`,
`destroy_weights_update_group`. Answers are {"success", "message", ...}."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from zpd.http.admin_routes import failure
from zpd.http.front import FRONT, json_response, read_body
from zpd.http.records import BadRequest, boolean, integer, refuse_unknown, string, take, text_field

routes = web.RouteTableDef()

DEFAULT_GROUP = "weight_update_group"      # SGLang's default group name
TRAINER_INITS = ("init_process_group", "init_custom_process_group")


def _list(name: str, value: Any) -> list:
    if not isinstance(value, list):
        raise BadRequest(f"{name!r} must be a list")
    return value


async def _answer(request: web.Request, command: str, done: str, timeout: float | None,
                  keep: tuple[str, ...], **args) -> web.Response:
    reply = await request.app[FRONT].backend.admin(command, timeout, **args)
    extra = {k: reply[k] for k in keep if k in reply}
    if reply.get("ok") and all(w.get("ok") for w in reply.get("workers", [])):
        return json_response({"success": True, "message": done} | extra)
    status, message = failure(reply)
    return json_response({"success": False, "message": message} | extra, status)


@routes.post("/init_weights_update_group")
async def init_weights_update_group(request: web.Request) -> web.Response:
    """Every worker joins the trainer's torch.distributed group as rank
    rank_offset + i (i in the order of the router's status); the trainer is rank 0.
    `backend` left out: nccl on CUDA workers, gloo on CPU ones. `trainer_init` (zpd's
    own) says how the trainer made its side (zpd/worker/trainer_group.py)."""
    body = await read_body(request)
    refuse_unknown(body, ("master_address", "master_port", "rank_offset", "world_size",
                          "group_name", "backend", "trainer_init"))
    args = {"master_address": take(body, "master_address", text_field),
            "master_port": take(body, "master_port", integer(1, 65535)),
            "rank_offset": take(body, "rank_offset", integer(1, 1 << 16), 1),
            "world_size": take(body, "world_size", integer(2, 1 << 16)),
            "group_name": take(body, "group_name", text_field, DEFAULT_GROUP)}
    for name in ("master_address", "master_port", "world_size"):
        if args[name] is None:
            raise BadRequest(f"{name!r} is required")
    backend = take(body, "backend", string)
    if backend is not None:
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"'backend' must be \"gloo\" or \"nccl\", not {backend!r:.40}")
        args["backend"] = backend
    trainer_init = take(body, "trainer_init", string)
    if trainer_init is not None:
        if trainer_init not in TRAINER_INITS:
            raise BadRequest(f"'trainer_init' must be one of {', '.join(TRAINER_INITS)}")
        args["trainer_init"] = trainer_init
    return await _answer(request, "init_weights_update_group",
                         f"joined weight group {args['group_name']!r}", None, ("ranks",), **args)


@routes.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """{"names", "dtypes", "shapes", "group_name", "weight_version", "load_format"}:
    answered once every worker has the new weights, or none has. SGLang's
    `flush_cache` is accepted (zpd keeps no cache to flush) and `abort_all_requests`
    aborts first."""
    body = await read_body(request)
    refuse_unknown(body, ("names", "dtypes", "shapes", "group_name", "weight_version",
                          "load_format", "flush_cache", "abort_all_requests"))
    args = {k: take(body, k, _list) for k in ("names", "dtypes", "shapes")}
    for name, value in args.items():
        if value is None:
            raise BadRequest(f"{name!r} is required")
    args["group_name"] = take(body, "group_name", text_field, DEFAULT_GROUP)
    version = take(body, "weight_version", text_field)
    if version is not None:
        args["weight_version"] = version
    load_format = take(body, "load_format", string)
    if load_format not in (None, "flattened_bucket"):
        raise BadRequest(f"'load_format' must be null or \"flattened_bucket\", not {load_format!r:.40}")
    if load_format is not None:
        args["load_format"] = load_format
    take(body, "flush_cache", boolean)
    front = request.app[FRONT]
    if take(body, "abort_all_requests", boolean, False):
        await front.backend.admin("abort_all")
    return await _answer(request, "update_weights_from_distributed",
                         f"weights received from group {args['group_name']!r}",
                         front.weights_timeout, ("weight_version", "seconds"), **args)


@routes.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await read_body(request, required=False)
    refuse_unknown(body, ("group_name",))
    name = take(body, "group_name", text_field, DEFAULT_GROUP)
    return await _answer(request, "destroy_weights_update_group",
                         f"weight group {name!r} destroyed", None, (), group_name=name)
