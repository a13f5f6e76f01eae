"""SGLang's trainer weight-sync routes, each one admin command on the router
(zpd/router/weights/sync.py says what the router and workers do):
`init_weights_update_group`, `update_weights_from_distributed`,
`update_weights_from_tensor`, `destroy_weights_update_group`, and zpd's own
`cancel_weight_update`. Answers are {"success", "message", ...}; a failed step's
message names each worker that failed, its step and tensor, and why."""
from __future__ import annotations

from aiohttp import web

from zpd.http.admin_routes import abort_all_first, command, failure, ignore_unknown, send
from zpd.http.front import FRONT, json_response, read_body
from zpd.http.records import BadRequest, boolean, integer, take
from zpd.wire.admin import (AdminCommand, CancelWeightUpdate, DestroyWeightsGroup,
                            InitWeightsGroup, UpdateFromDistributed, UpdateFromTensor)

routes = web.RouteTableDef()

DEFAULT_GROUP = "weight_update_group"      # SGLang's default group name


async def _answer(request: web.Request, cmd: AdminCommand, done: str, timeout: float | None,
                  keep: tuple[str, ...]) -> web.Response:
    reply = await send(request.app[FRONT], cmd, timeout)
    extra = {k: reply[k] for k in keep if k in reply}
    if reply.get("ok") and all(w.get("ok") for w in reply.get("workers", [])):
        return json_response({"success": True, "message": done} | extra)
    status, message = failure(reply)
    return json_response({"success": False, "message": message} | extra, status)


def _fields(body: dict, names: tuple[str, ...]) -> dict:
    return {name: body.get(name) for name in names}


def _or(body: dict, name: str, default: object) -> object:
    """Field `name`, or `default` when absent or null (SGLang's defaults)."""
    return default if body.get(name) is None else body[name]


@routes.post("/init_weights_update_group")
async def init_weights_update_group(request: web.Request) -> web.Response:
    """Every worker joins the trainer's torch.distributed group as rank
    rank_offset + i (i in the order of the router's status), or, given fewer ranks
    (world_size - rank_offset) than workers, that many do and the first relays each
    broadcast to the rest (zpd/router/weights/sync.py); the trainer is rank 0 and
    builds its side as SGLang's init_custom_process_group does. `backend` left out:
    nccl on CUDA workers, gloo on CPU ones. `trainer_init` (zpd's own):
    "init_process_group" for a trainer that made its side with torch's
    init_process_group (zpd/worker/weights/trainer_group.py). `pp_rank`: 0 only (zpd has no
    pipeline stages)."""
    body = await read_body(request)
    ignore_unknown(request, body, ("master_address", "master_port", "rank_offset", "world_size",
                                  "group_name", "backend", "trainer_init", "pp_rank"))
    if take(body, "pp_rank", integer(0, 1 << 16), 0) != 0:
        raise BadRequest("'pp_rank' must be 0: zpd serves no pipeline stages")
    cmd = command(InitWeightsGroup, **_fields(body, ("master_address", "master_port",
                                                     "world_size", "backend", "trainer_init")),
                  rank_offset=_or(body, "rank_offset", 1),
                  group_name=_or(body, "group_name", DEFAULT_GROUP))
    return await _answer(request, cmd, f"joined weight group {cmd.group_name!r}", None,
                         ("ranks", "relay"))


@routes.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """{"names", "dtypes", "shapes", "group_name", "weight_version", "load_format"}:
    answered once every worker has the new weights, or none has. SGLang's
    `flush_cache` is accepted (zpd keeps no cache to flush) and `abort_all_requests`
    aborts first."""
    body = await read_body(request)
    ignore_unknown(request, body, ("names", "dtypes", "shapes", "group_name", "weight_version",
                                  "load_format", "flush_cache", "abort_all_requests"))
    cmd = command(UpdateFromDistributed, **_fields(body, ("names", "dtypes", "shapes",
                                                          "weight_version", "load_format")),
                  group_name=_or(body, "group_name", DEFAULT_GROUP))
    take(body, "flush_cache", boolean)
    front = request.app[FRONT]
    await abort_all_first(front, body)
    return await _answer(request, cmd, f"weights received from group {cmd.group_name!r}",
                         front.weights_timeout, ("weight_version", "seconds"))


@routes.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: web.Request) -> web.Response:
    """SGLang's {"serialized_named_tensors": [base64 of a ForkingPickler dump of
    [(name, tensor), ...]] (one entry: every worker takes it; one per worker: worker i
    takes entry i), "load_format" (null, or "flattened_bucket": each entry pickles
    {"flattened_tensor", "metadata"}), "flush_cache", "abort_all_requests",
    "weight_version"}. The tensors stay in memory the trainer shares (shared memory
    with torch's "file_system" strategy, or CUDA IPC): the trainer must run on the
    workers' host, and send handles, not tensor bytes (MAX_PAYLOAD_CHARS in all).
    Two-phase, as update_weights_from_distributed; without a weight_version the
    version stays. SGLang's "direct" and custom loaders name code of their own: refused."""
    body = await read_body(request)
    ignore_unknown(request, body, ("serialized_named_tensors", "load_format", "flush_cache",
                                  "abort_all_requests", "weight_version",
                                  "disable_draft_model", "torch_empty_cache"))
    cmd = command(UpdateFromTensor, **_fields(body, ("serialized_named_tensors",
                                                     "weight_version", "load_format")))
    for name in ("flush_cache", "disable_draft_model", "torch_empty_cache"):
        take(body, name, boolean)     # nothing to do: zpd's caches follow the weights
    front = request.app[FRONT]
    await abort_all_first(front, body)
    return await _answer(request, cmd, "weights updated from tensors", front.weights_timeout,
                         ("weight_version", "seconds"))


@routes.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await read_body(request, required=False)
    ignore_unknown(request, body, ("group_name",))
    cmd = command(DestroyWeightsGroup, group_name=_or(body, "group_name", DEFAULT_GROUP))
    return await _answer(request, cmd, f"weight group {cmd.group_name!r} destroyed", None, ())


@routes.post("/cancel_weight_update")
async def cancel_weight_update(request: web.Request) -> web.Response:
    """zpd's own (the admin key guards it): end the init_weights_update_group or weight
    push under way. That call then answers 409 "cancelled by admin"; every worker keeps
    its old weights and version, leaves the trainer's group, and takes a new
    init_weights_update_group at once. Nothing under way: success, nothing changes."""
    body = await read_body(request, required=False)
    ignore_unknown(request, body, ())
    return await _answer(request, CancelWeightUpdate(), "weight update cancelled", None,
                         ("workers",))
