"""SGLang's routes and their answer shapes over a fake router (tests/unit/http_fake.py):
GET and POST where SGLang serves both, /get_server_info's fields as slime reads them,
loads, model lookup, aborts of finished requests, health while the router is down."""
from __future__ import annotations

import logging
import pytest

from tests.unit.http_fake import FakeBackend, call, front

WORKERS = [
    {"ok": True, "role": "prefill", "endpoint": "p:1", "weight_version": "v7", "dtype": "float32",
     "context_length": 8192, "page_size": 16, "max_batch": 64, "device": "cpu",
     "kv_pages": {"total": 10, "free": 8, "held": 2, "fenced": 0, "cached": 0},
     "queues": {"waiting": 1}, "prefix_cache": {"recent_hit_rate": 0.5}},
    {"ok": True, "role": "decode", "endpoint": "d:1", "weight_version": "v7", "dtype": "float32",
     "context_length": 8192, "page_size": 16, "max_batch": 32, "device": "cpu",
     "kv_pages": {"total": 20, "free": 15, "held": 4, "fenced": 1, "cached": 0},
     "queues": {"running": 3, "held": 0}},
    {"ok": True, "role": "decode", "endpoint": "d:2", "weight_version": "v7", "dtype": "float32",
     "context_length": 8192, "page_size": 16, "max_batch": 32, "device": "cpu",
     "kv_pages": {"total": 20, "free": 20, "held": 0, "fenced": 0, "cached": 0},
     "queues": {"running": 0, "held": 0}},
    {"ok": False, "role": "decode", "endpoint": "d:3", "status": 503, "error": "no heartbeat"},
]
STATUS = {"ok": False, "workers": WORKERS, "paused": None, "queued": 2, "inflight": 5}


def cluster_front(**replies) -> tuple:
    backend = FakeBackend(replies={"status": STATUS} | replies)
    return front(backend), backend


@pytest.mark.parametrize("path", ["/get_server_info", "/server_info"])
def test_server_info_answers_sglangs_fields_with_the_clusters_values(path):
    f, _ = cluster_front()
    status, info = call(f, "GET", path)
    assert status == 200
    # slime's external-engine check compares these with what it would have launched
    assert info["tp_size"] == 3 and info["dp_size"] == info["pp_size"] == info["ep_size"] == 1
    assert info["disaggregation_mode"] == "null" and info["enable_memory_saver"] is True
    assert info["nnodes"] == 1 and info["node_rank"] == 0
    assert info["host"] == "127.0.0.1" and isinstance(info["port"], int) and info["port"] > 0
    assert info["model_path"] == info["tokenizer_path"] == info["served_model_name"] == "tiny"
    assert info["weight_version"] == "v7" and info["dtype"] == "float32"
    assert info["context_length"] == 8192 and info["page_size"] == 16
    assert info["max_total_num_tokens"] == (20 + 20) * 16          # the decodes' pools
    assert info["max_running_requests"] == 64 and info["skip_tokenizer_init"] is False
    assert isinstance(info["version"], str) and len(info["internal_states"]) == 3
    assert info["zpd"]["queued"] == 2 and [w["endpoint"] for w in info["zpd"]["workers"]] == \
        ["p:1", "d:1", "d:2", "d:3"]
    assert "workers" not in info and info["api_key"] is None


def test_server_info_when_the_router_does_not_answer():
    f, _ = cluster_front(status={"ok": False, "status": 504, "error": "no answer"})
    status, body = call(f, "GET", "/get_server_info")
    assert status == 504 and "did not answer" in body["error"]["message"]


def test_health_is_503_while_the_router_or_every_worker_is_down():
    f, backend = cluster_front()
    assert call(f, "GET", "/health")[0] == 200
    assert backend.admins == [("status", {})]
    f, _ = cluster_front(status={"ok": False, "status": 504, "error": "no answer"})
    assert call(f, "GET", "/health")[0] == 503
    all_down = {"ok": False, "workers": [w | {"ok": False} for w in WORKERS]}
    f, _ = cluster_front(status=all_down)
    status, text = call(f, "GET", "/health")
    assert status == 503 and "no live worker" in text
    f, _ = cluster_front(status={"ok": True, "workers": []})
    assert call(f, "GET", "/health")[0] == 503


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_flush_cache_for_get_and_post_answers_text_as_sglang(method):
    f, backend = cluster_front()
    status, text = call(f, method, "/flush_cache")
    assert status == 200 and text.startswith("Cache flushed")
    busy = {"ok": False, "workers": [{"ok": False, "role": "prefill", "endpoint": "p:1",
                                      "status": 409, "error": "requests are running"}]}
    f, _ = cluster_front(flush_cache=busy)
    status, text = call(f, method, "/flush_cache")
    assert status == 400 and "requests are running" in text        # slime retries until 200
    assert call(f, "PUT", "/flush_cache")[0] == 405


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_memory_routes_take_sglangs_tags(method):
    f, backend = cluster_front()
    assert call(f, method, "/release_memory_occupation")[0] == 200
    assert call(f, method, "/release_memory_occupation", {"tags": ["weights"]})[0] == 200
    assert call(f, method, "/resume_memory_occupation", {"tags": None})[0] == 200
    assert call(f, method, "/resume_memory_occupation",
                {"tags": ["kv_cache", "weights", "cuda_graph"]})[0] == 200
    assert backend.admins == [("release_memory", {}), ("release_memory", {"tags": ["weights"]}),
                              ("resume_memory", {}),
                              ("resume_memory", {"tags": ["cuda_graph", "kv_cache", "weights"]})]
    status, body = call(f, method, "/release_memory_occupation", {"tags": ["gpu"]})
    assert status == 400 and "'gpu'" in body["error"]["message"]
    assert call(f, method, "/release_memory_occupation", {"tags": "weights", "x": 1})[0] == 200
    assert len(backend.admins) == 5 and backend.admins[-1][1] == {"tags": ["weights"]}


def test_update_weight_version_sets_every_workers_version():
    f, backend = cluster_front()
    status, body = call(f, "POST", "/update_weight_version", {"new_version": "step-3"})
    assert status == 200 and body == {"success": True, "new_version": "step-3",
                                      "message": "Weight version updated to step-3"}
    call(f, "POST", "/update_weight_version", {"new_version": "s4", "abort_all_requests": True})
    assert backend.admins == [("update_weight_version", {"weight_version": "step-3"}),
                              ("abort_all", {}), ("update_weight_version", {"weight_version": "s4"})]
    for bad in ({}, {"new_version": ""}, {"new_version": 3}, {"x": 1}):
        assert call(f, "POST", "/update_weight_version", bad)[0] == 400, bad
    assert len(backend.admins) == 3


def test_update_weight_version_needs_the_admin_key():
    f = front(api_key="user", admin_api_key="boss")
    body = {"new_version": "x"}
    assert call(f, "POST", "/update_weight_version", body,
                headers={"Authorization": "Bearer user"})[0] == 401
    assert call(f, "POST", "/update_weight_version", body,
                headers={"Authorization": "Bearer boss"})[0] == 200


def test_update_weights_from_disk_without_a_version_sends_none():
    f, backend = cluster_front()
    assert call(f, "POST", "/update_weights_from_disk", {"model_path": "/ckpt"})[0] == 200
    assert backend.admins == [("update_weights", {"path": "/ckpt"})]


def test_abort_of_a_finished_or_unknown_rid_is_200_and_a_live_one_is_aborted():
    gone = {"ok": False, "rid": "old", "status": 404, "error": "unknown rid 'old'"}
    f, backend = cluster_front(abort=gone)
    status, body = call(f, "POST", "/abort_request", {"rid": "old"})
    assert status == 200 and body["success"] is True and "not running" in body["message"]
    f, backend = cluster_front(abort={"ok": True, "rid": "live", "state": "inflight"})
    status, body = call(f, "POST", "/abort_request", {"rid": "live"})
    assert status == 200 and body["message"] == "request live aborted"
    assert backend.admins == [("abort", {"rid": "live"})]
    f, _ = cluster_front(abort={"ok": False, "status": 400, "error": "bad rid"})
    assert call(f, "POST", "/abort_request", {"rid": "x"})[0] == 400


def test_model_info_carries_the_weight_version():
    f, _ = cluster_front()
    status, info = call(f, "GET", "/get_model_info")
    assert status == 200 and info["weight_version"] == "v7" and info["is_generation"] is True
    assert info["model_path"] == info["tokenizer_path"] == "tiny"


def test_get_load_and_v1_loads_in_sglangs_shapes():
    f, _ = cluster_front()
    status, loads = call(f, "GET", "/get_load")
    # running: the decodes' batches (3); waiting: queued at the router (2) + in flight
    # but not running (5 - 3); tokens: pages held or fenced (2 + 4 + 1) x 16
    assert status == 200 and loads == [{"dp_rank": 0, "num_reqs": 7, "num_waiting_reqs": 4,
                                        "num_tokens": 7 * 16}]
    status, body = call(f, "GET", "/v1/loads")
    assert status == 200 and body["num_accelerators"] == 3 and body["accelerator"] == "cpu"
    load, = body["loads"]
    assert load["num_running_reqs"] == 3 and load["num_waiting_reqs"] == 4
    assert load["num_used_tokens"] == 112 and load["max_total_num_tokens"] == 50 * 16
    assert load["token_usage"] == pytest.approx(112 / 800) and load["cache_hit_rate"] == 0.5
    # not paused: the router's 2 queued wait for a share or a slot, none for a pause
    assert load["queues"] == {"waiting": 4, "grammar": 0, "paused": 0, "retracted": 0}
    status, body = call(f, "GET", "/v1/loads?include=queues")
    assert status == 200 and "num_running_reqs" not in body["loads"][0] and \
        "queues" in body["loads"][0]
    for query in ("include=bogus", "dp_rank=1", "format=prometheus"):
        status, body = call(f, "GET", f"/v1/loads?{query}")
        assert status == 400, query


def test_v1_loads_counts_the_routers_queue_as_paused_only_while_paused():
    f, _ = cluster_front(status=STATUS | {"paused": "retract"})
    status, body = call(f, "GET", "/v1/loads?include=queues")
    assert status == 200 and body["loads"][0]["queues"]["paused"] == 2


def test_v1_models_by_id():
    f, _ = cluster_front()
    status, model = call(f, "GET", "/v1/models/tiny")
    listed = call(f, "GET", "/v1/models")[1]["data"][0]
    assert status == 200 and model["id"] == listed["id"] == "tiny" and model["object"] == "model"
    status, body = call(f, "GET", "/v1/models/org/other-model")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert body["error"]["type"] == "invalid_request_error" and "other-model" in \
        body["error"]["message"]
    f = front(api_key="user")
    assert call(f, "GET", "/v1/models/tiny")[0] == 401


def test_health_and_server_info_say_memory_is_released():
    released = STATUS | {"memory_released": [{"endpoint": "d:1", "released": ["kv_cache"]}],
                         "workers": [w | {"memory": "released"} if w["ok"] else w for w in WORKERS]}
    f, _ = cluster_front(status=released)
    status, text = call(f, "GET", "/health")
    assert status == 200 and "memory released" in text and "/resume_memory_occupation" in text
    assert call(f, "GET", "/get_server_info")[1]["zpd"]["memory_released"] is True
    f, _ = cluster_front()
    assert call(f, "GET", "/health") == (200, "")
    assert call(f, "GET", "/get_server_info")[1]["zpd"]["memory_released"] is False


def test_admin_routes_take_unknown_keys_and_log_each_once(caplog):
    """SGLang's bodies drop what they do not declare: AReaL's older `abort_all_request`
    on /update_weights_from_disk (400 before) is dropped, logged once per name."""
    caplog.set_level(logging.WARNING, "zpd.http.fields")
    f, backend = cluster_front()
    for _ in range(2):
        status, body = call(f, "POST", "/update_weights_from_disk",
                            {"model_path": "/ckpt", "abort_all_request": True})
        assert status == 200 and body["success"], body
    assert backend.admins == [("update_weights", {"path": "/ckpt"})] * 2
    assert call(f, "POST", "/continue_generation", {"rid": "x"})[0] == 200
    logged = [r.getMessage() for r in caplog.records]
    assert sum("'abort_all_request'" in m for m in logged) == 1, logged
    assert any("/continue_generation" in m and "'rid'" in m for m in logged), logged
    assert call(f, "POST", "/update_weights_from_disk", {"abort_all_request": True})[0] == 400


def test_get_weights_by_name_answers_sglangs_nested_list():
    """SGLang's {"name", "truncate_size"} (GET or POST): the JSON body is the first
    worker's rows, a nested list; a worker's refusal keeps its status."""
    rows = [[0.5, -1.0], [2.0, 0.25]]
    f, backend = cluster_front(get_weights={"ok": True, "workers": [
        {"ok": True, "role": "prefill", "endpoint": "p:1", "values": rows},
        {"ok": True, "role": "decode", "endpoint": "d:1", "values": rows}]})
    name = "model.layers.0.self_attn.q_proj.weight"
    status, got = call(f, "POST", "/get_weights_by_name", {"name": name, "truncate_size": 2})
    assert status == 200 and got == rows
    assert call(f, "GET", f"/get_weights_by_name?name={name}")[1] == rows
    assert backend.admins[-2:] == [("get_weights", {"name": name, "truncate_size": 2}),
                                   ("get_weights", {"name": name, "truncate_size": 100})]
    for bad in ({}, {"name": name, "truncate_size": 0}, {"name": name, "truncate_size": "x"}):
        assert call(f, "POST", "/get_weights_by_name", bad)[0] == 400, bad
    f, _ = cluster_front(get_weights={"ok": False, "workers": [
        {"ok": False, "role": "decode", "endpoint": "d:1", "status": 400,
         "error": "no weight named 'x' in this model"}]})
    status, got = call(f, "POST", "/get_weights_by_name", {"name": "x"})
    assert status == 400 and "no weight named 'x'" in got["error"]["message"]
