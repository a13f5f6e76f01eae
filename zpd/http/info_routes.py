"""SGLang's information routes, answered from the router's status: /health,
/health_generate, /get_model_info, /get_server_info (also /server_info), /get_load,
/v1/loads, and OpenAI's /v1/models/{id}.

To a client the whole cluster is one SGLang engine: /get_server_info answers SGLang's
server-argument fields with zpd's values. `tp_size` is the number of ranks a trainer
must count behind this URL (every live worker, prefill and decode, in the order of the
router's status: the ranks /init_weights_update_group joins), with dp_size = pp_size =
1; `disaggregation_mode` is "null", because slime (and sglang-router) treat an engine
that says "prefill" or "decode" as half of a pair they must wire up themselves, while
zpd's router already pairs them. The router's own status is under "zpd"."""
from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from datetime import datetime, timezone

from aiohttp import web

import zpd
from engines.sampling_params import SamplingParams
from zpd.http.admin_routes import failure
from zpd.http.front import FRONT, Front, error_response, json_response
from zpd.http.records import BadRequest, GenRequest
from zpd.http.streams import run_all

routes = web.RouteTableDef()

HEALTH_TIMEOUT_S = 20.0        # /health_generate: one token through the cluster
STATUS_TIMEOUT_S = 2.0         # /health: the router's status
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")   # SGLang's


def served_id(front: Front) -> str:
    """The model id clients name (as /v1/models lists it)."""
    return front.model


def model_path(front: Front) -> str:
    return front.model_path or front.model


def tokenizer_path(front: Front) -> str:
    return front.tokenizer_path or model_path(front)


async def cluster_status(front: Front, timeout: float | None = None) -> dict:
    """The router's status; BadRequest (503/504) when the router did not answer."""
    reply = await front.backend.admin("status", timeout)
    if not reply.get("ok") and not reply.get("workers"):
        status, message = failure(reply)
        raise BadRequest(f"the router did not answer status: {message}", status, "server_error")
    return reply


def memory_released(reply: dict) -> bool:
    """Some worker's KV pool or weights are released (/release_memory_occupation): as
    the router holds new requests for it, or as a worker's own status says."""
    return bool(reply.get("memory_released")) or any(
        "released" in (w.get("memory"), w.get("weights_memory")) for w in live(reply))


def live(reply: dict) -> list[dict]:
    return [w for w in reply.get("workers", []) if w.get("ok")]


# --- health --------------------------------------------------------------------------

@routes.get("/health")
@routes.get("/ping")
@routes.post("/ping")
async def health(request: web.Request) -> web.Response:
    """200 while the router answers its status (quickly) with at least one live worker;
    503 otherwise. /health_generate is the deeper check (a token through the cluster).
    /ping is the same check, GET or POST, as vLLM's and SGLang's (SageMaker's probe).
    With memory released it stays 200 (the server lives, as SGLang's does) and says so."""
    try:
        reply = await cluster_status(request.app[FRONT], STATUS_TIMEOUT_S)
    except BadRequest as e:
        return web.Response(status=503, text=f"{e.message}\n")
    if live(reply) and memory_released(reply):
        return web.Response(status=200, text="memory released: generation waits for "
                                             "/resume_memory_occupation\n")
    if live(reply):
        return web.Response(status=200)
    return web.Response(status=503, text="the router has no live worker\n")


@routes.get("/health_generate")
async def health_generate(request: web.Request) -> web.Response:
    """One token through the whole cluster."""
    front = request.app[FRONT]
    probe = GenRequest(SamplingParams(max_new_tokens=1, temperature=0), input_ids=[0])
    try:
        out, = await asyncio.wait_for(run_all(front.backend, [probe], None), HEALTH_TIMEOUT_S)
    except asyncio.TimeoutError:
        return error_response(f"no token within {HEALTH_TIMEOUT_S:g} s (paused or overloaded?)",
                              503, "server_error")
    if out.aborted:
        return error_response(f"generation failed: {out.status} {out.finish.get('message')}",
                              503, "server_error")
    return web.Response(status=200)


# --- model and server ----------------------------------------------------------------

def _version(workers: list[dict]) -> str | None:
    versions = Counter(w.get("weight_version") for w in workers)
    return versions.most_common(1)[0][0] if versions else None


def _first(workers: list[dict], key: str, default=None):
    return next((w[key] for w in workers if w.get(key) is not None), default)


@routes.get("/get_model_info")
@routes.get("/model_info")
async def get_model_info(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    workers = live(await cluster_status(front))
    return json_response({
        "model_path": model_path(front), "tokenizer_path": tokenizer_path(front),
        "is_generation": True, "preferred_sampling_params": None,
        "weight_version": _version(workers), "has_tokenizer": front.tokenizer is not None,
        "has_chat_template": front.chat is not None})


def _token_counts(workers: list[dict]) -> tuple[int, int]:
    """(tokens in use by requests, token capacity) over every worker's KV pool."""
    used = total = 0
    for w in workers:
        pages, size = w.get("kv_pages") or {}, int(w.get("page_size") or 0)
        used += (int(pages.get("held", 0)) + int(pages.get("fenced", 0))) * size
        total += int(pages.get("total", 0)) * size
    return used, total


def server_args(front: Front, request: web.Request, reply: dict) -> dict:
    """SGLang's server-argument fields that clients read, with this cluster's values."""
    workers = live(reply)
    host, _, port = request.host.rpartition(":")
    decodes = [w for w in workers if w.get("role") == "decode"]
    _, capacity = _token_counts(decodes)
    return {
        "model_path": model_path(front), "tokenizer_path": tokenizer_path(front),
        "served_model_name": served_id(front), "skip_tokenizer_init": front.tokenizer is None,
        "host": host or request.host, "port": int(port) if port.isdigit() else None,
        "tp_size": len(workers), "dp_size": 1, "pp_size": 1, "ep_size": 1,
        "nnodes": 1, "node_rank": 0, "base_gpu_id": 0, "gpu_id_step": 1,
        "disaggregation_mode": "null", "enable_memory_saver": True,
        "dtype": _first(workers, "dtype", "auto"), "kv_cache_dtype": "auto",
        "context_length": _first(workers, "context_length"),
        "page_size": _first(workers, "page_size"), "max_total_num_tokens": capacity,
        "max_running_requests": sum(int(w.get("max_batch") or 0) for w in decodes) or None,
        "is_embedding": False, "weight_version": _version(workers),
        "api_key": None, "admin_api_key": None,       # never shown (SGLang shows its own)
    }


@routes.get("/get_server_info")
@routes.get("/server_info")
async def get_server_info(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    reply = await cluster_status(front)
    workers = reply.get("workers", [])
    return json_response(server_args(front, request, reply) | {
        "internal_states": [_internal_state(w) for w in live(reply)],
        "version": zpd.__version__,
        "zpd": {"router": front.router if front.sees_internals() else "[address]",
                "router_ok": bool(reply.get("ok")), "front_pid": os.getpid(),
                "paused": reply.get("paused"), "memory_released": memory_released(reply),
                "queued": reply.get("queued"),
                "inflight": reply.get("inflight"),
                "workers": [{k: w.get(k) for k in (
                    "role", "endpoint", "ok", "weight_version", "paused", "memory",
                    "weights_memory", "kv_pages", "queues")} for w in workers]}})


def _internal_state(w: dict) -> dict:
    """One worker's state, in the list SGLang keeps one entry per scheduler in."""
    used, total = _token_counts([w])
    return {"role": w.get("role"), "endpoint": w.get("endpoint"),
            "weight_version": w.get("weight_version"), "max_total_num_tokens": total,
            "num_used_tokens": used, "memory": w.get("memory"),
            "weights_memory": w.get("weights_memory")}


# --- loads ---------------------------------------------------------------------------

def _load(reply: dict) -> dict:
    """The cluster's load counted as SGLang's one DP rank counts its own."""
    workers = live(reply)
    decodes, prefills = ([w for w in workers if w.get("role") == r] for r in ("decode", "prefill"))
    running = sum(int((w.get("queues") or {}).get("running", 0)) for w in decodes)
    held = sum(int((w.get("queues") or {}).get("held", 0)) for w in decodes)
    inflight, queued = int(reply.get("inflight") or 0), int(reply.get("queued") or 0)
    used, total = _token_counts(workers)
    rates = [float((w.get("prefix_cache") or {}).get("recent_hit_rate", 0.0)) for w in prefills]
    return {"running": running, "waiting": queued + max(0, inflight - running),
            # the router's queue holds requests past a share and, while paused, all new ones
            "paused": queued if reply.get("paused") else 0, "held": held, "used": used, "total": total,
            "hit_rate": sum(rates) / len(rates) if rates else 0.0,
            "max_running": sum(int(w.get("max_batch") or 0) for w in decodes)}


@routes.get("/get_load")
async def get_load(request: web.Request) -> web.Response:
    """SGLang's list, one entry per DP rank (zpd's cluster is one)."""
    load = _load(await cluster_status(request.app[FRONT]))
    return json_response([{"dp_rank": 0, "num_reqs": load["running"] + load["waiting"],
                           "num_waiting_reqs": load["waiting"], "num_tokens": load["used"]}])


@routes.get("/v1/loads")
async def v1_loads(request: web.Request) -> web.Response:
    """SGLang's /v1/loads: ?include=core,queues,... (default all), ?dp_rank=0,
    ?format=json (prometheus is not served)."""
    include = _sections(request.query.get("include"))
    dp_rank = request.query.get("dp_rank")
    if dp_rank not in (None, "0"):
        raise BadRequest(f"'dp_rank': this server has one DP rank, 0, not {dp_rank!r:.20}")
    if request.query.get("format", "json") != "json":
        raise BadRequest("'format': only json is served")
    front = request.app[FRONT]
    reply = await cluster_status(front)
    workers = live(reply)
    return json_response({
        "timestamp": datetime.now(timezone.utc).isoformat(), "version": zpd.__version__,
        "accelerator": _first(workers, "device"), "num_accelerators": len(workers),
        "loads": [_load_entry(_load(reply), include)]})


def _sections(raw: str | None) -> set[str]:
    names = {s.strip() for s in raw.split(",")} if raw else {"all"}
    unknown = sorted(names - set(LOAD_SECTIONS))
    if unknown:
        raise BadRequest(f"'include': unknown section(s) {', '.join(unknown)}; "
                         f"known: {', '.join(LOAD_SECTIONS)}")
    return set(LOAD_SECTIONS) if "all" in names else names


def _load_entry(load: dict, include: set[str]) -> dict:
    entry = {"dp_rank": 0, "timestamp": time.time()}
    if "core" in include:
        entry |= {"num_running_reqs": load["running"], "num_waiting_reqs": load["waiting"],
                  "num_used_tokens": load["used"], "num_total_tokens": load["used"],
                  "max_total_num_tokens": load["total"],
                  "token_usage": round(load["used"] / load["total"], 6) if load["total"] else 0.0,
                  "gen_throughput": 0.0,            # not measured here: see /metrics
                  "cache_hit_rate": round(load["hit_rate"], 6),
                  "utilization": round(load["running"] / load["max_running"], 6)
                  if load["max_running"] else 0.0,
                  "max_running_requests": load["max_running"]}
    if "queues" in include:
        entry["queues"] = {"waiting": load["waiting"], "grammar": 0, "paused": load["paused"],
                           "retracted": load["held"]}
    return entry


# --- OpenAI ----------------------------------------------------------------------------

@routes.get("/v1/models/{model_id:.+}")
async def retrieve_model(request: web.Request) -> web.Response:
    """The served model's object (as /v1/models lists it); 404 in OpenAI's shape for
    any other id."""
    front, wanted = request.app[FRONT], request.match_info["model_id"]
    model = served_id(front)
    if wanted != model:
        return json_response({"error": {"message": f"The model '{wanted[:200]}' does not exist",
                                        "type": "invalid_request_error", "param": "model",
                                        "code": "model_not_found"}}, 404)
    return json_response({"id": model, "object": "model", "created": 0, "owned_by": "zpd",
                          "root": model})
