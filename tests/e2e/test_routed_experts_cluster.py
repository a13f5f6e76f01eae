"""Routed experts through a real 1P1D cluster (`--enable-return-routed-experts`): the
prompt's rows from the prefill, the output's from the decode, equal to transformers'
router choice at every position; across pause(retract) -> update_weights -> continue
(every row is then the new weights': the recompute's and the steps after it), after
the first token went ahead, and with a prefix-cache hit. One Qwen3-MoE cluster for the
module, float64; the refusal on a dense model has a tiny cluster of its own.

Every KV write takes 0.2 s longer (a transport fault plan), so a pause right after a
streamed first token lands while the KV is still in flight."""
from __future__ import annotations

import asyncio

import numpy as np
import orjson
import pytest
import torch

from tests.e2e.cluster import Cluster, assert_all_pages_free
from zpd.client import assemble
from tests.unit.hf_models import by_expert, decoded, hf_model, make_checkpoint, reference_routing

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")
pytest.importorskip("transformers", reason="transformers is the test-time reference")
aiohttp = pytest.importorskip("aiohttp")

ROUTED = {"return_routed_experts": True, "return_routed_expert_weights": True}
LAYERS, TOP_K = 3, 2            # tests/unit/hf_models.py's qwen3_moe (layer 1 dense)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    dirs = {"w1": make_checkpoint("qwen3_moe", root, seed=0),
            "w2": make_checkpoint("qwen3_moe", root, seed=1)}
    return dirs, {v: hf_model(d, torch.float64) for v, d in dirs.items()}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, ckpts):
    dirs, _ = ckpts
    with Cluster(tmp_path_factory.mktemp("routed"), model=str(dirs["w1"]),
                 extra=("--enable-return-routed-experts", "--weight-version", "w1",
                        "--http-port", "0"),
                 env={"ZPD_TRANSPORT_FAULT": "delay:seconds=0.2"}) as c:
        yield c


def http(cluster, body: dict) -> tuple[int, object]:
    """POST /generate: (status, the JSON answer or the list of SSE events)."""
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://{cluster.info['http']}/generate", data=orjson.dumps(body),
                              headers={"Content-Type": "application/json"}) as r:
                text = await r.text()
                if r.content_type == "text/event-stream":
                    return r.status, [e[6:] if e[6:] == "[DONE]" else orjson.loads(e[6:])
                                      for e in text.split("\n\n") if e.startswith("data: ")]
                return r.status, orjson.loads(text)
    return asyncio.run(go())


def check_rows(out: dict, meta: dict, prompt: list[int], ref) -> None:
    """The answer's routed experts and weights are `ref`'s router choice for every
    position of prompt + output[:-1], and nothing else."""
    tokens = prompt + out["output_ids"]
    ids = decoded(meta, "routed_experts", np.int32, LAYERS, TOP_K)
    weights = decoded(meta, "routed_expert_weights", np.float32, LAYERS, TOP_K)
    assert ids.shape == weights.shape == (len(tokens) - 1, LAYERS, TOP_K)
    want_ids, want_w = by_expert(*reference_routing(ref, tokens[:-1], LAYERS, TOP_K))
    got_ids, got_w = by_expert(ids, weights.astype(np.float64))
    bad = [pos for pos in range(len(tokens) - 1) if (got_ids[pos] != want_ids[pos]).any()]
    assert not bad, f"{out.get('rid')}: positions {bad} of {len(tokens) - 1} (prompt {len(prompt)})"
    np.testing.assert_allclose(got_w, want_w, rtol=0, atol=1e-6)
    assert not ids[:, 1].any()                  # the dense layer's rows are zeros


def stream_until(client, rid: str, tokens: int) -> list[dict]:
    """Chunks of `rid` until it has `tokens` output tokens (or ended)."""
    chunks = []
    while sum(len(c["token_ids"]) for c in chunks) < tokens:
        chunks.append(client.receive(timeout=60))
        assert chunks[-1]["rid"] == rid
        if chunks[-1]["finished"]:
            break
    return chunks


def finish(client, chunks: list[dict]) -> dict:
    while not chunks[-1]["finished"]:
        chunks.append(client.receive(timeout=60))
    return assemble(chunks)


def test_generate_over_http_equals_transformers(cluster, ckpts):
    _, refs = ckpts
    prompts = [[5, 9, 200, 17], list(range(40, 77))]        # within a page, across pages
    status, answers = http(cluster, {
        "input_ids": prompts, "sampling_params": {"temperature": 0, "max_new_tokens": 7,
                                                  "ignore_eos": True}} | ROUTED)
    assert status == 200, answers
    for prompt, answer in zip(prompts, answers):
        check_rows(answer, answer["meta_info"], prompt, refs["w1"])
    # streamed: the final event carries them (SGLang's), the others do not
    status, events = http(cluster, {
        "input_ids": prompts[0], "stream": True, "return_routed_experts": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}})
    assert status == 200 and events[-1] == "[DONE]"
    carrying = [e for e in events[:-1] if "routed_experts" in e["meta_info"]]
    assert carrying == [events[-2]] and "routed_expert_weights" not in events[-2]["meta_info"]
    ids = decoded(events[-2]["meta_info"], "routed_experts", np.int32, LAYERS, TOP_K)
    assert ids.shape == (len(prompts[0]) + 5 - 1, LAYERS, TOP_K)


def test_http_and_the_client_answer_the_same_int32_rows(cluster, ckpts):
    """The rows travel compact (uint8 ids, in a rows message ahead of the final tokens);
    /generate's and zpd.Client's answers widen them to the same base64 of int32, which
    decodes to transformers' choice, with and without the weights."""
    _, refs = ckpts
    prompt = [(11 * i + 3) % 290 for i in range(70)]
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with cluster.client() as client:
        for ask in (ROUTED, {"return_routed_experts": True}):
            status, answer = http(cluster, {"input_ids": prompt, "sampling_params": params} | ask)
            assert status == 200, answer
            out = client.generate(input_ids=prompt, sampling_params=params | ask)
            assert out["output_ids"] == answer["output_ids"]
            meta = answer["meta_info"]
            assert [k for k in meta if k.startswith("routed")] == [k[7:] for k in ask]
            for key in ask:
                assert meta[key[7:]] == out["meta"][key[7:]], key
        tokens = prompt + answer["output_ids"]
        ids = decoded(meta, "routed_experts", np.int32, LAYERS, TOP_K)
        want, _ = reference_routing(refs["w1"], tokens[:-1], LAYERS, TOP_K)
        assert ids.shape == want.shape == (len(tokens) - 1, LAYERS, TOP_K)
        assert (np.sort(ids, -1) == np.sort(want, -1)).all()
        assert_all_pages_free(client)
    assert "dropping rows" not in cluster.log.read_text()


def test_prefix_cache_hit_keeps_every_row(cluster, ckpts):
    """The same 3-page prompt again (its pages in both workers' prefix caches): every
    row is there and right, plain or asking, first or second time."""
    _, refs = ckpts
    prompt = [(7 * i) % 290 for i in range(48)]
    params = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
    with cluster.client() as client:
        client.generate(input_ids=prompt, sampling_params=params)        # fills the caches
        for _ in range(2):
            out = client.generate(input_ids=prompt, sampling_params=params | ROUTED)
            check_rows(out, out["meta"], prompt, refs["w1"])
        assert_all_pages_free(client)


def test_retract_update_continue_rows_are_the_new_weights(cluster, ckpts):
    """One request paused mid-output, one right after its first token went ahead of its
    KV: after continue every row of both is W2's router choice (the recompute's rows
    for prompt + output[:-1], then the decode's), while their tokens span w1 then w2."""
    dirs, refs = ckpts
    params = {"temperature": 0, "ignore_eos": True} | ROUTED
    prompts = {"mid": [3, 1, 4, 1, 5, 9, 2, 6], "early": [2, 7, 1, 8, 2, 8]}
    outs = {}
    with cluster.client() as client, cluster.client() as admin:
        client.submit(input_ids=prompts["mid"], rid="mid", stream=True,
                      sampling_params=params | {"max_new_tokens": 300})
        mid = stream_until(client, "mid", 3)
        pause(admin, dirs["w2"])
        outs["mid"] = finish(client, mid)
        pause(admin, dirs["w1"], "w1")                      # back to W1 for the next
        client.submit(input_ids=prompts["early"], rid="early", stream=True,
                      sampling_params=params | {"max_new_tokens": 6})
        early = stream_until(client, "early", 1)            # the prefill's token, KV in flight
        pause(admin, dirs["w2"])
        outs["early"] = finish(client, early)
        assert_all_pages_free(client)
        assert admin.admin("update_weights", path=str(dirs["w1"]), version="w1")["ok"]
    versions = outs["mid"]["weight_versions"]
    assert versions[0] == "w1" and versions[-1] == "w2", "not paused in the middle of its output"
    assert outs["early"]["weight_versions"] == ["w1"] + ["w2"] * 5
    for rid, out in outs.items():
        assert out["meta"]["retractions"] == 1
        check_rows(out, out["meta"], prompts[rid], refs["w2"])
    assert "which its prefill sent ahead" in cluster.log.read_text()


def pause(admin, path, version: str = "w2") -> None:
    assert admin.admin("pause", mode="retract", timeout=30)["ok"]
    assert admin.admin("update_weights", path=str(path), version=version)["ok"]
    assert admin.admin("continue")["ok"]


def test_refused_by_name_on_a_dense_model(tmp_path):
    """400 naming the field on a dense model (tiny, without the flag); the refused
    requests keep no page."""
    with Cluster(tmp_path, extra=("--http-port", "0")) as dense:
        status, answer = http(dense, {"input_ids": [1, 2, 3], "return_routed_experts": True,
                                      "sampling_params": {"max_new_tokens": 2}})
        assert status == 400, answer
        assert "return_routed_experts" in answer["error"]["message"]
        assert "dense" in answer["error"]["message"]
        with dense.client() as client:
            out = client.generate(input_ids=[1, 2, 3], sampling_params={
                "max_new_tokens": 2, "return_routed_expert_weights": True})
            assert out["finish_reason"]["status_code"] == 400
            assert "dense" in out["finish_reason"]["message"]
            assert_all_pages_free(client)
