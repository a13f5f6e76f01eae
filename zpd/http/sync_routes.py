"""SGLang's trainer weight-sync routes, each one admin command on the router
(zpd/router/weight_sync.py says what the router and workers do):
`init_weights_update_group`, `update_weights_from_distributed`,
`update_weights_from_tensor`, `destroy_weights_update_group`, and zpd's own
`cancel_weight_update`. Answers are {"success", "message", ...}; a failed step's
message names each worker that failed, its step and tensor, and why."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from engines.formats.tensor_payload import MAX_PAYLOAD_CHARS
from zpd.http.admin_routes import failure
from zpd.http.front import FRONT, json_response, read_body
from zpd.http.records import BadRequest, boolean, integer, refuse_unknown, string, take, text_field

routes = web.RouteTableDef()

DEFAULT_GROUP = "weight_update_group"      # SGLang's default group name
TRAINER_INITS = ("init_custom_process_group", "init_process_group")


def port(name: str, value: Any) -> int:
    """An integer, or its decimal string (AReaL sends `master_port` as one)."""
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 5:
        value = int(value)
    return integer(1, 65535)(name, value)


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
    rank_offset + i (i in the order of the router's status); the trainer is rank 0 and
    builds its side as SGLang's init_custom_process_group does. `backend` left out:
    nccl on CUDA workers, gloo on CPU ones. `trainer_init` (zpd's own):
    "init_process_group" for a trainer that made its side with torch's
    init_process_group (zpd/worker/trainer_group.py). `pp_rank`: 0 only (zpd has no
    pipeline stages)."""
    body = await read_body(request)
    refuse_unknown(body, ("master_address", "master_port", "rank_offset", "world_size",
                          "group_name", "backend", "trainer_init", "pp_rank"))
    if take(body, "pp_rank", integer(0, 1 << 16), 0) != 0:
        raise BadRequest("'pp_rank' must be 0: zpd serves no pipeline stages")
    args = {"master_address": take(body, "master_address", text_field),
            "master_port": take(body, "master_port", port),
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


@routes.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """SGLang's {"serialized_named_tensors": [base64 of a ForkingPickler dump of
    [(name, tensor), ...]] (one entry: every worker takes it; one per worker: worker i
    takes entry i), "load_format" (null, or "flattened_bucket": each entry pickles
    {"flattened_tensor", "metadata"}), "flush_cache", "abort_all_requests",
    "weight_version"}. The tensors stay in memory the trainer shares (shared memory
    with torch's "file_system" strategy, or CUDA IPC): the trainer must run on the
    workers' host. Two-phase, as update_weights_from_distributed; without a
    weight_version the version stays."""
    body = await read_body(request)
    refuse_unknown(body, ("serialized_named_tensors", "load_format", "flush_cache",
                          "abort_all_requests", "weight_version", "disable_draft_model",
                          "torch_empty_cache"))
    entries = take(body, "serialized_named_tensors", _list)
    if not entries or not all(isinstance(e, str) and e for e in entries):
        raise BadRequest("'serialized_named_tensors' must be a non-empty list of base64 strings")
    if sum(map(len, entries)) > MAX_PAYLOAD_CHARS:
        raise BadRequest(f"'serialized_named_tensors' holds more than {MAX_PAYLOAD_CHARS} "
                         "characters: send shared-memory handles, not tensor bytes")
    load_format = take(body, "load_format", string)
    if load_format not in (None, "flattened_bucket"):      # SGLang's "direct" and custom
        raise BadRequest(f"'load_format' must be null or \"flattened_bucket\", not "
                         f"{load_format!r:.40}")           # loaders name code of its own
    args = {"serialized_named_tensors": entries}
    if load_format is not None:
        args["load_format"] = load_format
    version = take(body, "weight_version", text_field)
    if version is not None:
        args["weight_version"] = version
    for name in ("flush_cache", "disable_draft_model", "torch_empty_cache"):
        take(body, name, boolean)     # nothing to do: zpd's caches follow the weights
    front = request.app[FRONT]
    if take(body, "abort_all_requests", boolean, False):
        await front.backend.admin("abort_all")
    return await _answer(request, "update_weights_from_tensor", "weights updated from tensors",
                         front.weights_timeout, ("weight_version", "seconds"), **args)


@routes.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await read_body(request, required=False)
    refuse_unknown(body, ("group_name",))
    name = take(body, "group_name", text_field, DEFAULT_GROUP)
    return await _answer(request, "destroy_weights_update_group",
                         f"weight group {name!r} destroyed", None, (), group_name=name)


@routes.post("/cancel_weight_update")
async def cancel_weight_update(request: web.Request) -> web.Response:
    """zpd's own (the admin key guards it): end the init_weights_update_group or weight
    push under way. That call then answers 409 "cancelled by admin"; every worker keeps
    its old weights and version, leaves the trainer's group, and takes a new
    init_weights_update_group at once. Nothing under way: success, nothing changes."""
    body = await read_body(request, required=False)
    refuse_unknown(body, ())
    return await _answer(request, "cancel_weight_update", "weight update cancelled", None,
                         ("workers",))
