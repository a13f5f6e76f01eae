"""`zpd http` end to end: a real cluster started by `zpd launch --http-port`, spoken to
with the real `openai` client and with raw HTTP as SGLang's users send it.

One cluster for the module, on the tiny model written as a GGUF file (same weights
as `tiny`, a byte-level tokenizer and a chatml template, so chat completions run);
float64, so greedy outputs equal `zpd run`'s token for token."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import orjson
import pytest

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from engines.models.tiny import save_tiny
from tests.e2e.cluster import ROOT, Cluster, assert_all_pages_free, zpd_cmd
from tests.unit.gguf_files import write_tiny_gguf
from tests.unit.grammar_checks import EBNF, LONG_SCHEMA, REGEX, SCHEMA, matches, valid_json

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")
aiohttp = pytest.importorskip("aiohttp")
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

KEY, ADMIN = "user-key", "admin-key"


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, gguf):
    with Cluster(tmp_path_factory.mktemp("http"), model=gguf,
                 extra=("--http-port", "0", "--api-key", KEY, "--admin-api-key", ADMIN,
                        "--insecure")) as c:      # an admin key without CURVE: loopback only
        yield c


@pytest.fixture(scope="module")
def reference(gguf):
    return load_model(gguf, dtype="float64")


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.info['http']}/v1", api_key=KEY, max_retries=0,
                         timeout=120)


def greedy(model, prompt: list[int], n: int) -> list[int]:
    (out,) = OfflineEngine(model).run([Request("ref", prompt, SamplingParams(
        temperature=0, max_new_tokens=n, ignore_eos=True))])
    return out["output_ids"]


def http(cluster, method: str, path: str, body=None, key: str | None = KEY,
         raw: bytes | None = None) -> tuple[int, object]:
    """One request: (status, JSON answer, or the list of SSE events)."""
    async def go():
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        data = raw if raw is not None else (orjson.dumps(body) if body is not None else None)
        async with aiohttp.ClientSession() as s:
            async with s.request(method, f"http://{cluster.info['http']}{path}", data=data,
                                 headers=headers) as r:
                text = await r.text()
                if r.content_type == "text/event-stream":
                    return r.status, [e[6:] if e[6:] == "[DONE]" else orjson.loads(e[6:])
                                      for e in text.split("\n\n") if e.startswith("data: ")]
                return r.status, orjson.loads(text) if text else None
    return asyncio.run(go())


def test_models_and_greedy_completions_equal_zpd_run(cluster, oai, reference, gguf):
    assert [m.id for m in oai.models.list().data] == [gguf]
    prompts = [[5, 6, 7], [104, 101, 108, 108, 111], list(range(40, 77))]
    got = oai.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    tok = reference.tokenizer
    assert [c.text for c in got.choices] == [tok.decode(greedy(reference, p, 12)) for p in prompts]
    assert got.usage.prompt_tokens == sum(map(len, prompts)) and got.usage.completion_tokens == 36
    status, body = http(cluster, "POST", "/generate", {"input_ids": prompts, "sampling_params": {
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}})
    assert status == 200 and [b["output_ids"] for b in body] == \
        [greedy(reference, p, 12) for p in prompts]


def test_streamed_text_equals_the_whole_answer(oai):
    kw = dict(model="tiny", prompt=["Hello", "The sky"], max_tokens=20, temperature=0.8, seed=3,
              n=2, stop=["x"])
    whole = oai.completions.create(**kw)
    texts, usage = {}, None
    for ev in oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in ev.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = ev.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert whole.choices[0].text != whole.choices[1].text       # copies got seed and seed + 1
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_chat_completions_through_the_template(oai, reference):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    whole = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=16,
                                        temperature=0)
    ids = reference.encode_chat(messages)
    (ref,) = OfflineEngine(reference).run([Request("c", ids, SamplingParams(temperature=0,
                                                                            max_new_tokens=16))])
    assert whole.choices[0].message.content == ref["text"]
    assert whole.usage.prompt_tokens == len(ids)
    streamed = "".join(ev.choices[0].delta.content or "" for ev in oai.chat.completions.create(
        model="tiny", messages=messages, max_tokens=16, temperature=0, stream=True))
    assert streamed == ref["text"]


def test_chat_on_a_model_without_template_is_a_clear_400(cluster, tmp_path):
    ready = tmp_path / "http.json"
    proc = subprocess.Popen(zpd_cmd("http", "--router", cluster.router, "--model", "tiny",
                                    "--port", "0", "--ready-file", str(ready)), cwd=ROOT)
    try:
        for _ in range(300):
            if ready.exists():
                break
            time.sleep(0.1)
        ep = orjson.loads(ready.read_bytes())["endpoint"]
        client = openai.OpenAI(base_url=f"http://{ep}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}])
        assert "no chat template" in str(e.value)
    finally:
        proc.terminate()
        proc.wait(20)


def test_slime_and_areal_payloads(cluster):
    slime = {"input_ids": [1, 2, 3], "sampling_params": {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 6, "stop": None,
        "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
        "spaces_between_special_tokens": False, "ignore_eos": True}}
    status, body = http(cluster, "POST", "/generate", slime)
    assert status == 200 and len(body["output_ids"]) == 6
    assert body["meta_info"]["finish_reason"]["type"] == "length"
    meta = body["meta_info"]
    assert meta["output_token_weight_versions"] == [meta["weight_version"]] * 6
    assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 6}]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["cached_tokens"] >= 0 and meta["e2e_latency"] > 0
    areal = {"input_ids": [9, 8, 7], "return_logprob": True, "stream": False, "sampling_params": {
        "top_p": 1.0, "top_k": 100000000, "max_new_tokens": 5, "temperature": 0.0,
        "stop_token_ids": [257], "frequency_penalty": 0.0, "ignore_eos": True}}
    for body_ in (slime | {"return_logprob": True}, areal):
        status, body = http(cluster, "POST", "/generate", body_)
        assert status == 200, body
        lps = body["meta_info"]["output_token_logprobs"]
        assert [t for _, t, _ in lps] == body["output_ids"]
        assert all(isinstance(lp, float) and lp <= 0 for lp, _, _ in lps)


def test_scoring_as_slime_distillation_sends_it(cluster, reference):
    """max_new_tokens 0 with prompt logprobs, whole and streamed: the prefill's answer,
    zpd run's numbers; the decode hears nothing of it."""
    prompt = [5, 17, 99, 3, 42, 7, 8, 200, 13, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    ref = OfflineEngine(reference).run([Request("ref", prompt, SamplingParams(
        max_new_tokens=0, return_logprob=True, logprob_start_len=0))])[0]["input_token_logprobs"]
    client = cluster.client()
    decode_before = [w["counters"] for w in client.admin("status")["workers"] if w["role"] == "decode"]
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0}
    status, whole = http(cluster, "POST", "/generate", body)
    assert status == 200, whole
    status, events = http(cluster, "POST", "/generate", body | {"stream": True})
    assert status == 200 and events[-1] == "[DONE]"
    for got in (whole, events[-2]):
        meta = got["meta_info"]
        assert got["output_ids"] == [] and got["text"] == "" and meta["completion_tokens"] == 0
        assert meta["finish_reason"] == {"type": "length", "length": 0}
        assert [t for _, t, _ in meta["input_token_logprobs"]] == prompt
        assert meta["input_token_logprobs"][0][0] is None
        assert [v for v, _, _ in meta["input_token_logprobs"][1:]] == \
            pytest.approx([v for v, _ in ref[1:]], abs=1e-4)
    status_after = client.admin("status")["workers"]
    assert [w["counters"] for w in status_after if w["role"] == "decode"] == decode_before
    client.close()


def test_openai_logprobs(oai):
    got = oai.completions.create(model="tiny", prompt=[1, 2, 3], max_tokens=4, temperature=0,
                                 logprobs=2, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    for sampled, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and sampled == pytest.approx(max(top.values()))   # greedy
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=4, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(len(c.top_logprobs) == 3 and c.logprob <= 0 for c in content)


def test_bad_requests_get_400_and_the_server_keeps_serving(cluster):
    for path, raw in (("/generate", b"{not json"), ("/generate", b'{"input_ids": [1, 300]}'),
                      ("/generate", b'{"input_ids": [1, "a"]}'),
                      ("/v1/completions", b'{"prompt": [1], "max_tokens": -1}'),
                      ("/v1/chat/completions", b'{"messages": [{"role": "user"}]}')):
        status, body = http(cluster, "POST", path, raw=raw)
        assert status == 400 and body["error"]["code"] == 400, (path, raw, body)
    assert http(cluster, "GET", "/nope")[0] == 404
    assert http(cluster, "GET", "/v1/models", key=None)[0] == 401
    assert http(cluster, "POST", "/flush_cache", key=KEY)[0] == 401
    assert http(cluster, "GET", "/health", key=None)[0] == 200
    assert http(cluster, "GET", "/health_generate")[0] == 200
    assert http(cluster, "POST", "/generate", {"input_ids": [1]})[0] == 200


def test_a_disconnect_mid_stream_aborts_the_request(cluster):
    """Paused (retract) while it streams, the request could only end by an abort: the
    HTTP client hanging up must be that abort."""
    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            r = await s.post(f"http://{cluster.info['http']}/generate", json={
                "input_ids": [1, 2], "stream": True, "rid": "gone-1",
                "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}})
            await r.content.readuntil(b"\n\n")
            async with s.post(f"http://{cluster.info['http']}/pause_generation",
                              json={"mode": "retract"},
                              headers={"Authorization": f"Bearer {ADMIN}"}) as a:
                assert a.status == 200, await a.text()
            r.close()
    with cluster.client() as client:
        try:
            asyncio.run(go())
            for _ in range(100):
                status = client.admin("status")
                if status["inflight"] == 0:
                    break
                time.sleep(0.05)
            assert status["inflight"] == 0 and status["paused"] == "retract"
        finally:
            assert client.admin("continue")["ok"]
        assert_all_pages_free(client)


def test_pause_retract_update_continue_over_http(cluster, reference, gguf, tmp_path):
    w2 = str(save_tiny(tmp_path / "w2", seed=2))
    models = {"w2": load_model(w2, dtype="float64")}
    first = reference.version

    async def go():
        url = f"http://{cluster.info['http']}"
        admin = {"Authorization": f"Bearer {ADMIN}"}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            r = await s.post(f"{url}/generate", json={"input_ids": [3, 1, 4, 1, 5], "stream": True,
                             "sampling_params": {"temperature": 0, "max_new_tokens": 1200,
                                                 "ignore_eos": True}})
            events = [orjson.loads((await r.content.readuntil(b"\n\n"))[6:])]
            for path, body in (("/pause_generation", {"mode": "retract"}),
                               ("/update_weights_from_disk", {"model_path": w2,
                                                              "weight_version": "w2"}),
                               ("/continue_generation", None)):
                async with s.post(url + path, json=body, headers=admin) as a:
                    assert a.status == 200 and (await a.json())["success"], await a.text()
            async for line in r.content:
                if line.startswith(b"data: {"):
                    events.append(orjson.loads(line[6:]))
            return events
    try:
        events = asyncio.run(go())
    finally:
        status, body = http(cluster, "POST", "/update_weights_from_disk",
                            {"model_path": gguf, "weight_version": first}, key=ADMIN)
        assert status == 200, body
    last = events[-1]
    ids, versions = last["output_ids"], last["meta_info"]["output_token_weight_versions"]
    assert len(ids) == 1200 and last["meta_info"]["retractions"] == 1
    cut = versions.index("w2")
    assert 0 < cut and set(versions[:cut]) == {first} and set(versions[cut:]) == {"w2"}
    assert ids[:cut] == greedy(reference, [3, 1, 4, 1, 5], cut)
    assert ids[cut:] == greedy(models["w2"], [3, 1, 4, 1, 5] + ids[:cut], 1200 - cut)
    assert http(cluster, "GET", "/get_weight_version")[1]["weight_version"] == first


def test_the_rl_loop_example(cluster, reference, gguf, tmp_path):
    ckpt = save_tiny(tmp_path / "step-1", seed=1)
    try:
        run = subprocess.run([sys.executable, "examples/rl_loop.py", "--url",
                              f"http://{cluster.info['http']}", "--api-key", KEY,
                              "--admin-api-key", ADMIN, "--checkpoint", str(ckpt),
                              "--prompts", "2", "--max-new-tokens", "600"],
                             cwd=ROOT, capture_output=True, text=True, timeout=300)
    finally:
        status, body = http(cluster, "POST", "/update_weights_from_disk",
                            {"model_path": gguf, "weight_version": reference.version}, key=ADMIN)
        assert status == 200, body
    assert run.returncode == 0, run.stderr
    spans = [line for line in run.stdout.splitlines() if line.startswith("rollout ")]
    assert len(spans) == 2, run.stdout
    for line in spans:
        assert f"by {reference.version}, " in line and "by step-1" in line, run.stdout


def test_256_concurrent_streams_none_lost(cluster, reference):
    prompts = [[i % 250, 7, i // 250] for i in range(256)]
    reqs = [Request(f"r{i}", p, SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True))
            for i, p in enumerate(prompts)]
    expected = [o["text"] for o in OfflineEngine(reference).run(reqs)]

    async def one(s, i):
        async with s.post(f"http://{cluster.info['http']}/v1/completions", json={
                "prompt": prompts[i], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status == 200
            text, done = "", False
            async for line in r.content:
                if line.startswith(b"data: {"):
                    text += orjson.loads(line[6:])["choices"][0]["text"]
                done |= line.strip() == b"data: [DONE]"
            return text if done else None

    async def go():
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, headers={
                "Authorization": f"Bearer {KEY}"}) as s:
            return await asyncio.gather(*(one(s, i) for i in range(256)))
    assert asyncio.run(go()) == expected
    with cluster.client() as client:
        status = client.admin("status")
    assert status["inflight"] == 0
    for w in status["workers"]:          # every page came back
        assert w["kv_pages"]["free"] + w["kv_pages"]["cached"] == w["kv_pages"]["total"], w


def test_non_loopback_without_key_exits_2():
    proc = subprocess.run(zpd_cmd("http", "--router", "127.0.0.1:1", "--model", "tiny",
                                  "--host", "0.0.0.0"), cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "--api-key" in proc.stderr


def scrape(cluster) -> dict:
    """GET /metrics, parsed with prometheus_client's own parser: name -> samples."""
    from prometheus_client.parser import text_string_to_metric_families

    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://{cluster.info['http']}/metrics",
                             headers={"Authorization": f"Bearer {KEY}"}) as r:
                assert r.status == 200 and r.content_type == "text/plain"
                return await r.text()
    families = text_string_to_metric_families(asyncio.run(go()))
    return {f.name: f.samples for f in families}


def value(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def test_metrics_move_by_what_was_generated(cluster):
    before = scrape(cluster)
    assert "zpd:time_to_first_token_seconds" in before and "zpd:kv_pages" in before
    body = {"input_ids": [[3, 4, 5], [6, 7]], "sampling_params": {
        "temperature": 0, "max_new_tokens": 7, "ignore_eos": True}, "stream": True}
    assert http(cluster, "POST", "/generate", body)[0] == 200
    after = scrape(cluster)

    def moved(family: str, sample: str, **labels) -> float:
        return value(after[family], sample, **labels) - value(before.get(family, []), sample, **labels)

    assert moved("zpd:generation_tokens", "zpd:generation_tokens_total") == 14
    assert moved("zpd:prompt_tokens", "zpd:prompt_tokens_total") == 5
    assert moved("zpd:request_finished", "zpd:request_finished_total", finished_reason="length") == 2
    assert moved("zpd:prefill_tokens_computed", "zpd:prefill_tokens_computed_total") == 5
    assert moved("zpd:kv_transfer_bytes", "zpd:kv_transfer_bytes_total") > 0
    assert moved("zpd:time_to_first_token_seconds", "zpd:time_to_first_token_seconds_count") == 2
    # a streamed request's tokens after its first (a chunk of n spreads its gap over n)
    assert 0 < moved("zpd:inter_token_latency_seconds", "zpd:inter_token_latency_seconds_count") <= 12
    assert moved("zpd:e2e_request_latency_seconds", "zpd:e2e_request_latency_seconds_count") == 2
    pages = {(s.labels["role"], s.labels["state"]): s.value for s in after["zpd:kv_pages"]}
    assert pages[("decode", "free")] == pages[("decode", "total")] > 0
    assert value(after["zpd:worker_up"], "zpd:worker_up") == 2
    # the same under SGLang's names, labelled with the served model (its dashboard's)
    assert moved("sglang:generation_tokens", "sglang:generation_tokens_total") == 14
    assert moved("sglang:prompt_tokens", "sglang:prompt_tokens_total") == 5
    assert moved("sglang:num_requests", "sglang:num_requests_total") == 2
    assert moved("sglang:time_to_first_token_seconds",
                 "sglang:time_to_first_token_seconds_count") == 2
    assert moved("sglang:e2e_request_latency_seconds",
                 "sglang:e2e_request_latency_seconds_count") == 2
    assert value(after["sglang:gen_throughput"], "sglang:gen_throughput") > 0
    assert value(after["sglang:max_total_num_tokens"], "sglang:max_total_num_tokens") > 0
    for family in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:cache_hit_rate"):
        assert after[family] and all(s.labels["model_name"] for s in after[family]), family


def test_structured_output_through_1p1d(cluster, oai, reference):
    """response_format through the openai client, /generate's regex and the zpd client's
    json_schema: greedy and seeded outputs follow their grammar, and equal zpd run's."""
    fmt = {"type": "json_schema", "json_schema": {"name": "rec", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "a record, please"}]
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 1}, {"temperature": 1.0, "seed": 2}):
        got = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=80,
                                          response_format=fmt, **kw).choices[0]
        assert got.finish_reason == "stop" and valid_json(got.message.content), got
        want = SamplingParams(max_new_tokens=80, json_schema=orjson.dumps(SCHEMA).decode(), **kw)
        (ref,) = OfflineEngine(reference).run([Request("c", reference.encode_chat(messages), want)])
        assert got.message.content == ref["text"]
    status, body = http(cluster, "POST", "/generate", {"text": ["a", "b"], "sampling_params": {
        "regex": REGEX, "max_new_tokens": 40, "temperature": 1.0, "seed": 4}})
    assert status == 200 and all(matches(REGEX, b["text"]) for b in body), body
    status, body = http(cluster, "POST", "/generate", {"text": "a", "sampling_params": {"regex": "(("}})
    assert status == 400 and "'sampling_params.regex' does not compile" in body["error"]["message"]
    with cluster.client() as client:
        out = client.generate([5, 6], sampling_params={"ebnf": EBNF, "temperature": 0})
        assert out["finish_reason"]["type"] == "stop" and matches("yes|no|maybe [0-9]", out["text"])
        bad = client.generate([5, 6], sampling_params={"json_schema": "{"})
        assert bad["finish_reason"]["status_code"] == 400, bad
        assert "'sampling_params.json_schema' is not JSON" in bad["finish_reason"]["message"]


def test_structured_output_across_a_retraction_over_http(cluster, reference):
    schema = orjson.dumps(LONG_SCHEMA).decode()
    asks = [{"temperature": 0}, {"temperature": 1.0, "seed": 3}]

    async def go():
        url, admin = f"http://{cluster.info['http']}", {"Authorization": f"Bearer {ADMIN}"}
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {KEY}"}) as s:
            streams = [await s.post(f"{url}/generate", json={"input_ids": [7, 8], "stream": True,
                       "sampling_params": a | {"json_schema": schema, "max_new_tokens": 400}})
                       for a in asks]
            events = [[orjson.loads((await r.content.readuntil(b"\n\n"))[6:])] for r in streams]
            for path, body in (("/pause_generation", {"mode": "retract"}), ("/continue_generation", None)):
                async with s.post(url + path, json=body, headers=admin) as a:
                    assert a.status == 200, await a.text()
            for r, got in zip(streams, events):
                got += [orjson.loads(line[6:]) async for line in r.content if line.startswith(b"data: {")]
            return [got[-1] for got in events]
    for last, a in zip(asyncio.run(go()), asks):
        assert last["meta_info"]["retractions"] == 1 and valid_json(last["text"], LONG_SCHEMA), last
        want = SamplingParams(max_new_tokens=400, json_schema=schema, **a)
        (ref,) = OfflineEngine(reference).run([Request("r", [7, 8], want)])
        assert last["output_ids"] == ref["output_ids"]
