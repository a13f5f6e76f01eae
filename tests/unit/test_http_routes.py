"""The HTTP routes over a fake router (tests/unit/http_fake.py): what each route sends,
how it answers, its errors and its keys; the server keeps serving after each."""
from __future__ import annotations

import asyncio

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.unit.http_fake import FakeBackend, call, chunk, front, sse_events, tiny_answer
from zpd.http.guard.plug import guarded_app

ABORT = {"type": "abort", "status_code": 503, "message": "decode 1.2.3.4:5 is unavailable"}


def test_generate_single_batch_and_stream():
    f = front()
    status, body = call(f, "POST", "/generate", {"input_ids": [1, 2, 3]})
    assert status == 200 and body["text"] == "Hi!" and body["output_ids"] == [72, 105, 33]
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
    status, body = call(f, "POST", "/generate", {"text": ["a", "b"], "sampling_params": {
        "max_new_tokens": 3}})
    assert status == 200 and [b["text"] for b in body] == ["Hi!", "Hi!"]
    assert f.backend.requests[-1].text == "b" and f.backend.requests[-1].sampling.to_wire() == \
        {"max_new_tokens": 3}
    status, events = call(f, "POST", "/generate", {"input_ids": [1], "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    assert [e["text"] for e in events[:-1]] == ["H", "Hi", "Hi!"]         # cumulative
    assert [e["output_ids"] for e in events[:-1]] == [[72], [72, 105], [72, 105, 33]]
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "length", "length": 3}


def test_an_abort_answers_200_but_a_refusal_answers_400():
    refuse = {"type": "abort", "status_code": 400, "message": "token id 300 out of range"}
    f = front(FakeBackend(lambda req, rid: [chunk(rid, [], refuse, {})]))
    for stream in (False, True):
        status, body = call(f, "POST", "/generate", {"input_ids": [300], "stream": stream})
        assert status == 400 and "out of range" in body["error"]["message"], body
        assert body["error"]["code"] == 400 and body["error"]["type"] == "invalid_request_error"
    f = front(FakeBackend(lambda req, rid: tiny_answer(req, rid, [72], ABORT)))
    status, body = call(f, "POST", "/generate", {"input_ids": [1]})
    assert status == 200
    assert body["meta_info"]["finish_reason"] == ABORT | {"err_type": "ServiceUnavailableError"}
    status, body = call(f, "POST", "/v1/completions", {"prompt": [1]})
    assert status == 503 and body["error"]["code"] == 503 and "unavailable" in body["error"]["message"]
    status, events = call(f, "POST", "/v1/completions", {"prompt": [1], "stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    last = events[-2]["choices"][0]
    assert last["finish_reason"] == "abort" and last["error"]["code"] == 503


@pytest.mark.parametrize("method, path, raw, status", [
    ("POST", "/generate", b"not json", 400),
    ("POST", "/generate", b"[1, 2]", 400),
    ("POST", "/generate", b"", 400),
    ("POST", "/generate", b'{"input_ids": [1, -1]}', 400),
    ("POST", "/generate", b'{"input_ids": [1], "sampling_params": {"max_new_tokens": "x"}}', 400),
    ("POST", "/v1/completions", b'{"prompt": "a", "max_tokens": -3}', 400),
    ("POST", "/v1/chat/completions", b'{"messages": "hi"}', 400),
    ("POST", "/pause_generation", b'{"mode": "sideways"}', 400),
    ("POST", "/abort_request", b'{}', 400),
    ("POST", "/update_weights_from_disk", b'{"weight_version": "x"}', 400),
    ("POST", "/no/such/route", b"{}", 404),
    ("GET", "/generate", None, 405),
    ("POST", "/generate", b'{"text": "' + b"x" * 70000 + b'"}', 413),
])
def test_bad_requests_answer_openai_shaped_errors_and_the_server_lives(method, path, raw, status):
    f = front()
    got, body = call(f, method, path, raw=raw)
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "code"} and body["error"]["code"] == status
    assert call(f, "POST", "/generate", {"input_ids": [1]})[0] == 200
    assert f.backend.requests == [f.backend.requests[-1]]      # nothing bad reached the router


def test_chat_needs_a_template():
    status, body = call(front(), "POST", "/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and "no chat template" in body["error"]["message"]


def test_streamed_completion_text_equals_the_whole_answer_with_usage_last():
    f = front(FakeBackend(lambda req, rid: tiny_answer(req, rid, list(b"hello world"), per_chunk=2)))
    status, ids = call(f, "POST", "/v1/completions", {"prompt": [[65, 66]], "echo": True})
    assert status == 200 and ids["choices"][0]["text"] == "ABhello world"   # echo of token ids
    body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 11, "echo": True}
    status, whole = call(f, "POST", "/v1/completions", body)
    assert status == 200 and [c["index"] for c in whole["choices"]] == [0, 1, 2, 3]
    assert whole["choices"][2]["text"] == "bhello world"
    assert whole["usage"] == {"prompt_tokens": 6, "completion_tokens": 44, "total_tokens": 50}
    status, events = call(f, "POST", "/v1/completions", body | {
        "stream": True, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    assert events[-2]["usage"] == whole["usage"]
    texts, finishes = {}, {}
    for e in events[:-2]:
        assert e["usage"] is None and len(e["choices"]) == 1
        c = e["choices"][0]
        texts[c["index"]] = texts.get(c["index"], "") + c["text"]
        if c["finish_reason"]:
            assert c["index"] not in finishes
            finishes[c["index"]] = c["finish_reason"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}
    assert finishes == {i: "length" for i in range(4)}


def test_seeds_differ_between_copies():
    f = front()
    call(f, "POST", "/v1/completions", {"prompt": "a", "n": 3, "seed": 11})
    assert [r.sampling.to_wire()["seed"] for r in f.backend.requests] == [11, 12, 13]


def test_admin_routes_make_one_router_call_each():
    f = front()
    assert call(f, "POST", "/pause_generation", {"mode": "retract"}) == \
        (200, {"success": True, "message": "paused (retract)"})
    call(f, "POST", "/pause_generation")
    call(f, "POST", "/continue_generation")
    call(f, "POST", "/update_weights_from_disk", {"model_path": "/ckpt", "weight_version": "s2",
                                                  "abort_all_requests": True})
    call(f, "POST", "/abort_request", {"rid": "x"})
    call(f, "POST", "/abort_request", {"abort_all": True})
    call(f, "POST", "/flush_cache")
    call(f, "POST", "/release_memory_occupation", {"tags": ["kv_cache"]})
    call(f, "POST", "/resume_memory_occupation")
    assert f.backend.admins == [
        ("pause", {"mode": "retract"}), ("pause", {"mode": "abort"}), ("continue", {}),
        ("abort_all", {}), ("update_weights", {"path": "/ckpt", "weight_version": "s2"}),
        ("abort", {"rid": "x"}), ("abort_all", {}), ("flush_cache", {}),
        ("release_memory", {"tags": ["kv_cache"]}),
        ("resume_memory", {})]
    assert call(f, "GET", "/get_weight_version")[1]["weight_version"] == "v1"
    info = call(f, "GET", "/get_model_info")[1]
    assert info["model_path"] == "tiny" and info["is_generation"] is True


def test_a_failed_admin_command_answers_its_status():
    f = front(FakeBackend(replies={"update_weights": {"ok": False, "workers": [
        {"ok": False, "role": "prefill", "endpoint": "p:1", "status": 409,
         "error": "requests in flight"}]}}))
    status, body = call(f, "POST", "/update_weights_from_disk", {"model_path": "/x"})
    assert status == 409 and body["success"] is False and "requests in flight" in body["message"]


def test_keys_guard_every_route_but_health_and_the_admin_key_guards_admin_routes():
    f = front(api_key="user", admin_api_key="boss")
    bearer = lambda k: {"Authorization": f"Bearer {k}"}      # noqa: E731
    assert call(f, "GET", "/health")[0] == 200
    for headers in (None, bearer("wrong"), {"Authorization": "user"}):
        status, body = call(f, "GET", "/v1/models", headers=headers)
        assert status == 401 and body["error"]["type"] == "authentication_error"
    assert call(f, "GET", "/v1/models", headers=bearer("user"))[0] == 200
    assert call(f, "GET", "/v1/models", headers=bearer("boss"))[0] == 200
    assert call(f, "POST", "/pause_generation", headers=bearer("user"))[0] == 401
    assert call(f, "POST", "/pause_generation", headers=bearer("boss"))[0] == 200
    assert call(f, "POST", "/pause%5Fgeneration", headers=bearer("user"))[0] == 401
    only_user = front(api_key="user")
    assert call(only_user, "POST", "/flush_cache", headers=bearer("user"))[0] == 200
    assert call(only_user, "POST", "/flush_cache")[0] == 401
    only_admin = front(admin_api_key="boss")
    assert call(only_admin, "POST", "/generate", {"input_ids": [1]})[0] == 200
    assert call(only_admin, "POST", "/flush_cache")[0] == 401


def test_a_client_that_disconnects_mid_stream_closes_its_requests():
    backend = FakeBackend(lambda req, rid: tiny_answer(req, rid, [72, 105, 33]), block_after=1)
    f = front(backend)

    async def go():
        async with TestClient(TestServer(guarded_app(f))) as client:
            resp = await client.post("/v1/completions", json={"prompt": [1], "n": 2,
                                                              "stream": True})
            assert (await resp.content.readuntil(b"\n\n")).startswith(b"data: ")
            resp.close()                                  # hang up mid-stream
            for _ in range(100):
                if len(backend.closed) == 2:
                    break
                await asyncio.sleep(0.02)
    asyncio.run(go())
    assert sorted(backend.closed) == ["r0", "r1"]


def test_sse_parser_reads_done():
    assert sse_events('data: {"a": 1}\n\ndata: [DONE]\n\n') == [{"a": 1}, "[DONE]"]


@pytest.mark.parametrize("argv", [
    ["http", "--model", "tiny", "--host", "0.0.0.0"],
    ["launch", "--model", "tiny", "--host", "0.0.0.0", "--curve-keys", "keys", "--http-port", "0"],
])
def test_a_network_host_without_an_api_key_is_refused(argv, capsys, monkeypatch):
    from zpd.ops.cli import main
    monkeypatch.delenv("ZPD_API_KEY", raising=False)
    assert main(argv) == 2
    assert "--api-key" in capsys.readouterr().err


def test_launch_hands_the_keys_to_its_http_child_through_the_environment():
    from zpd.env import http_child_environ, http_keys
    env = http_child_environ("k", None, {"PATH": "/bin", "ZPD_ADMIN_API_KEY": "old"})
    assert env == {"PATH": "/bin", "ZPD_API_KEY": "k"} and http_keys(env) == ("k", None)


def test_a_request_the_backend_cannot_take_ends_with_500_and_the_batch_goes_on():
    class Refusing(FakeBackend):
        def open(self, req, sink):
            if req.input_ids == [2]:
                raise RuntimeError("lost")
            return super().open(req, sink)
    status, body = call(front(Refusing()), "POST", "/generate", {"input_ids": [[1], [2]]})
    assert status == 200 and body[0]["output_ids"] == [72, 105, 33]
    assert body[1]["meta_info"]["finish_reason"]["status_code"] == 500
    assert "lost" in body[1]["meta_info"]["finish_reason"]["message"]


def test_weight_sync_routes_send_what_sglang_clients_send():
    f = front(FakeBackend(replies={"init_weights_update_group": {"ok": True, "workers": [],
                                                                 "ranks": {"p:1": 1, "d:1": 2}}}))
    status, body = call(f, "POST", "/init_weights_update_group", {
        "master_address": "10.0.0.1", "master_port": 29500, "rank_offset": 1, "world_size": 3,
        "group_name": "g", "backend": "gloo"})
    assert status == 200 and body["success"] and body["ranks"] == {"p:1": 1, "d:1": 2}
    call(f, "POST", "/init_weights_update_group", {"master_address": "h", "master_port": 1,
                                                   "world_size": 2})
    spec = {"names": ["model.norm.weight"], "dtypes": ["bfloat16"], "shapes": [[64]]}
    call(f, "POST", "/update_weights_from_distributed", spec | {
        "group_name": "g", "weight_version": "s3", "load_format": "flattened_bucket",
        "flush_cache": True})
    call(f, "POST", "/destroy_weights_update_group", {"group_name": "g"})
    call(f, "POST", "/destroy_weights_update_group")
    assert f.backend.admins == [
        ("init_weights_update_group", {"master_address": "10.0.0.1", "master_port": 29500,
                                       "rank_offset": 1, "world_size": 3, "group_name": "g",
                                       "backend": "gloo"}),
        # SGLang's defaults: rank_offset 1, group "weight_update_group"; the backend is
        # the workers' (nccl on CUDA, gloo on CPU)
        ("init_weights_update_group", {"master_address": "h", "master_port": 1, "rank_offset": 1,
                                       "world_size": 2, "group_name": "weight_update_group"}),
        ("update_weights_from_distributed", spec | {"group_name": "g", "weight_version": "s3",
                                                    "load_format": "flattened_bucket"}),
        ("destroy_weights_update_group", {"group_name": "g"}),
        ("destroy_weights_update_group", {"group_name": "weight_update_group"})]


@pytest.mark.parametrize("path, body, why", [
    ("/init_weights_update_group", {"master_port": 1, "world_size": 2}, "master_address"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 0, "world_size": 2},
     "master_port"),
    ("/init_weights_update_group", {"master_address": "h", "master_port": 1, "world_size": 2,
                                    "backend": "mpi"}, "backend"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]}, "shapes"),
    ("/update_weights_from_distributed", {"names": "a", "dtypes": [], "shapes": []}, "names"),
    ("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]],
                                          "load_format": "direct"}, "load_format"),
])
def test_weight_sync_routes_refuse_bad_bodies(path, body, why):
    f = front()
    status, got = call(f, "POST", path, body)
    assert status == 400 and why in got["error"]["message"], got
    assert f.backend.admins == []


def test_weight_sync_routes_need_the_admin_key():
    f = front(api_key="user", admin_api_key="boss")
    body = {"names": ["a"], "dtypes": ["float32"], "shapes": [[1]]}
    for headers in (None, {"Authorization": "Bearer user"}):
        assert call(f, "POST", "/update_weights_from_distributed", body, headers=headers)[0] == 401
    assert call(f, "POST", "/update_weights_from_distributed", body,
                headers={"Authorization": "Bearer boss"})[0] == 200
