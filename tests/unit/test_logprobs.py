"""Logprobs: the engine's against an independent reference, the cluster's against
`zpd run`'s (the first token's from the prefill included, across a retraction), what
travels when nobody asks, and the client's chunks."""
from __future__ import annotations

import math
import socket
from collections import Counter

import pytest
import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request, as_float32
from engines.runner import ModelRunner
from engines.sampler import SamplingParams, token_logprobs
from tests.unit.inproc import InprocCluster
from transport import FaultRule
from zpd.client import Client, assemble
from zpd.wire import protocol as p
from zpd.wire.net import Router

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]
PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.25}


@pytest.fixture(scope="module")
def tiny64():
    return load_model("tiny", dtype="float64")


def offline(model, params: SamplingParams, prompt: list[int] = PROMPT) -> Request:
    req = Request("ref", list(prompt), params)
    OfflineEngine(model, kv_cache_mb=1).run([req])
    return req


def reference_distributions(model, req: Request) -> list[list[float]]:
    """For each output position: the log-distribution sampled from, computed apart from
    the sampler: a whole-prefix forward, the penalties and log-softmax by hand in float64."""
    p = req.params
    pool = KVPool.with_budget(KVLayout.for_model(model.cfg, 16, model.dtype), 1, model.dtype,
                              model.device)
    runner, out = ModelRunner(model, pool), []
    pages = pool.allocator.alloc(pool.pages_for(len(req.prompt) + len(req.output)))
    for n in range(len(req.output)):
        before = req.output[:n]
        with torch.inference_mode():
            logits = runner.prefill([req.prompt + before], [pages])[0].tolist()
        seen, counts = set(req.prompt) | set(before), Counter(before)
        for t in range(len(logits)):
            if t in seen:
                r = p.repetition_penalty
                logits[t] = logits[t] / r if logits[t] > 0 else logits[t] * r
            logits[t] -= p.frequency_penalty * counts[t] + p.presence_penalty * (counts[t] > 0)
        scaled = [x / (p.temperature or 1.0) for x in logits]
        top = max(scaled)
        lse = top + math.log(sum(math.exp(x - top) for x in scaled))
        out.append([x - lse for x in scaled])
    return out


def check_against_reference(model, req: Request, n_top: int) -> None:
    dists = reference_distributions(model, req)
    assert len(req.output_logprobs) == len(req.output) == len(dists)
    for token, got, top, dist in zip(req.output, req.output_logprobs, req.output_top_logprobs, dists):
        assert abs(got - dist[token]) < 1e-9
        assert abs(sum(math.exp(x) for x in dist) - 1) < 1e-9
        best = sorted(range(len(dist)), key=lambda t: -dist[t])[:n_top]
        assert [t for t, _ in top] == best
        assert all(abs(v - dist[t]) < 1e-9 for t, v in top)
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        if dist[token] >= dist[best[-1]]:                 # the sampled token made the top N
            assert token in [t for t, _ in top]


# --- the engine -----------------------------------------------------------------------


@pytest.mark.parametrize("penalties", [{}, PENALTIES], ids=["plain", "penalties"])
def test_greedy_logprobs_are_the_reference_distribution(tiny64, penalties):
    req = offline(tiny64, SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True,
                                         top_logprobs_num=5, **penalties))
    check_against_reference(tiny64, req, 5)
    assert all(top[0][0] == t for t, top in zip(req.output, req.output_top_logprobs))  # argmax


@pytest.mark.parametrize("cut", [{}, {"top_k": 5}, {"top_p": 0.5, "min_p": 0.05}],
                         ids=["full", "top_k", "top_p_min_p"])
def test_sampled_logprobs_are_before_truncation(tiny64, cut):
    """Sampled from the filtered distribution; reported from the one after penalties and
    temperature, before top-k/top-p/min-p, so never -inf for the sampled token."""
    req = offline(tiny64, SamplingParams(temperature=0.7, seed=3, max_new_tokens=10,
                                         ignore_eos=True, top_logprobs_num=20, **PENALTIES, **cut))
    check_against_reference(tiny64, req, 20)
    assert all(math.isfinite(v) for v in req.output_logprobs)


def test_return_logprob_alone_has_no_alternatives(tiny64):
    req = offline(tiny64, SamplingParams(temperature=0, max_new_tokens=4, return_logprob=True))
    assert len(req.output_logprobs) == len(req.output) and req.output_top_logprobs == []
    resp = OfflineEngine(tiny64, kv_cache_mb=1).run(
        [Request("r", PROMPT, SamplingParams(temperature=0, max_new_tokens=4, return_logprob=True))])[0]
    assert resp["output_token_logprobs"] == as_float32(req.output_logprobs)
    assert "output_top_logprobs" not in resp


def test_requests_not_asking_cost_nothing(tiny64, monkeypatch):
    """No log-softmax at all for a batch where nobody asks; only the asking rows otherwise."""
    rows = []
    real = torch.log_softmax
    monkeypatch.setattr(torch, "log_softmax", lambda x, dim: rows.append(x.shape[0]) or real(x, dim=dim))
    logits = torch.randn(3, 50, dtype=torch.float64)
    plain, asking = SamplingParams(), SamplingParams(top_logprobs_num=2)
    assert token_logprobs(logits, [plain] * 3, [0, 1, 2]) == ([None] * 3, [None] * 3, [None] * 3)
    assert rows == []
    lps, tops, _ = token_logprobs(logits, [plain, asking, plain], [0, 1, 2])
    assert rows == [1] and lps[0] is None and lps[1] is not None and tops[2] is None
    req = offline(tiny64, SamplingParams(temperature=0, max_new_tokens=3))
    assert req.output_logprobs == [] and req.output_top_logprobs == []
    resp = OfflineEngine(tiny64, kv_cache_mb=1).run([Request("r", PROMPT, req.params)])[0]
    assert "output_token_logprobs" not in resp and "output_top_logprobs" not in resp


@pytest.mark.parametrize("raw, named", [
    ({"top_logprobs_num": 21}, "top_logprobs_num"), ({"top_logprobs_num": -1}, "top_logprobs_num"),
    ({"top_logprobs_num": True}, "top_logprobs_num"), ({"top_logprobs_num": 2.0}, "top_logprobs_num"),
    ({"return_logprob": 1}, "return_logprob"), ({"return_logprob": "yes"}, "return_logprob"),
])
def test_bad_logprob_parameters_are_named(raw, named):
    with pytest.raises(ValueError, match=named):
        SamplingParams.from_dict(raw)


def test_top_logprobs_num_implies_logprobs():
    assert SamplingParams(top_logprobs_num=1).wants_logprobs
    assert SamplingParams(return_logprob=True).wants_logprobs
    assert not SamplingParams().wants_logprobs
    assert SamplingParams(top_logprobs_num=20).top_logprobs_num == 20


# --- the cluster against `zpd run` ----------------------------------------------------------


def cluster_vs_offline(c: InprocCluster, rid: str, sampling: dict, max_new: int) -> None:
    """The client's logprobs are `zpd run`'s response's, number for number."""
    got = c.run(rid)
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new,
                                       "ignore_eos": True} | sampling)
    ref = OfflineEngine(c.prefill.model, kv_cache_mb=1).run([Request("ref", PROMPT, params)])[0]
    assert got.token_ids == ref["output_ids"] and len(got.token_ids) == max_new
    assert got.logprobs == ref["output_token_logprobs"]
    if params.top_logprobs_num:
        assert [[list(pair) for pair in top] for top in got.top_logprobs] == ref["output_top_logprobs"]
    else:
        assert got.top_logprobs is None and "output_top_logprobs" not in ref


SAMPLINGS = {
    "greedy": {"return_logprob": True},
    "greedy_top": {"top_logprobs_num": 4, **PENALTIES},
    "seeded": {"temperature": 0.8, "seed": 5, "top_k": 20, "top_logprobs_num": 3, **PENALTIES},
}


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_cluster_logprobs_equal_zpd_run(cluster, sampling, stream):
    rid = cluster.submit(PROMPT, 6, stream=stream, sampling=sampling)
    cluster_vs_offline(cluster, rid, sampling, 6)
    cluster.check_pages()


def test_first_token_logprob_comes_from_the_prefill_ahead_of_the_kv(cluster):
    """A streamed request's first token goes from the prefill straight to the router:
    with its logprob and alternatives, which are those of `zpd run`'s first token."""
    firsts = []
    relay = cluster.router.on_first_tokens
    cluster.router.on_first_tokens = lambda w, msg: (firsts.append(msg), relay(w, msg))
    sampling = {"top_logprobs_num": 2}
    rid = cluster.submit(PROMPT, 4, sampling=sampling)
    cluster_vs_offline(cluster, rid, sampling, 4)
    (part,) = firsts[0].unpack()
    got = cluster.answers[rid]
    assert part.logprobs == got.logprobs[:1] and part.top_logprobs == got.top_logprobs[:1]


def test_retraction_keeps_one_logprob_per_token(cluster):
    sampling = {"top_logprobs_num": 2, **PENALTIES}
    rid = cluster.submit(PROMPT, 20, sampling=sampling)
    cluster.until(lambda: rid in cluster.answers and len(cluster.answers[rid].token_ids) >= 4)
    assert cluster.admin("pause", mode="retract")["ok"]
    assert cluster.admin("continue")["ok"]
    cluster_vs_offline(cluster, rid, sampling, 20)      # nothing lost, nothing twice
    assert cluster.answers[rid].meta["retractions"] == 1
    cluster.check_pages()


def test_retraction_before_the_kv_keeps_the_early_tokens_logprob():
    """The prefill sent the first token ahead, then a retraction caught the request
    before its KV reached the decode: continue hands the decode that token with its
    logprobs, and the client gets every token's once."""
    c = InprocCluster(fault_plan=FaultRule("hang", count=1))      # the first write hangs
    try:
        sampling = {"top_logprobs_num": 3}
        rid = c.submit(PROMPT, 6, sampling=sampling)
        c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) == 1)
        assert c.admin("pause", mode="retract")["ok"]
        assert c.router.inflight[rid].early is not None
        assert c.admin("continue")["ok"]
        held = c.decode.scheduler.by_rid[rid].req             # resumes after the early token
        first = c.answers[rid]
        assert held.output == first.token_ids and held.output_logprobs == first.logprobs
        assert held.output_top_logprobs == first.top_logprobs
        cluster_vs_offline(c, rid, sampling, 6)
        assert c.answers[rid].meta["retractions"] == 1
        c.check_pages()
    finally:
        c.close()


def test_no_logprob_keys_or_frames_for_requests_not_asking(cluster):
    frames = []
    decode = cluster.client._decode
    cluster.client._decode = lambda f, peer: (frames.append(len(f)), decode(f, peer))[1]
    plain = cluster.submit(PROMPT, 5)
    assert cluster.run(plain).logprobs is None and cluster.answers[plain].top_logprobs is None
    assert frames and max(frames) == 4                 # header, counts, token ids, starts
    asking = cluster.submit(PROMPT, 5, sampling={"return_logprob": True})
    other = cluster.submit(PROMPT[1:], 5)
    assert len(cluster.run(asking).logprobs) == 5
    assert cluster.run(other).logprobs is None         # in the same messages, without any
    assert max(frames) == 6                            # + logprob_mode, logprobs; no top
    cluster.check_pages()


def test_kv_done_without_the_asked_logprob_fails_the_request(cluster, monkeypatch):
    """A prefill that leaves the first token's logprob out (a bug, or a peer that does
    not know them): the request fails clearly, the pages come back."""
    monkeypatch.setattr("zpd.worker.writes.first_logprob_fields", lambda req: {})
    got = cluster.run(cluster.submit(PROMPT, 4, stream=False, sampling={"return_logprob": True}))
    assert got.status == 500 and "no logprob for the first token" in got.finish["message"]
    cluster.pump()
    cluster.check_pages()
    cluster.serves_again()


@pytest.mark.parametrize("n", [21, -1])
def test_bad_top_logprobs_num_is_400(cluster, n):
    got = cluster.run(cluster.submit(PROMPT, 4, sampling={"top_logprobs_num": n}))
    assert got.status == 400 and "top_logprobs_num must be an integer in [0, 20]" in \
        got.finish["message"] and f"got {n}" in got.finish["message"]
    cluster.check_pages()


# --- the client ------------------------------------------------------------------------------


def test_client_chunks_and_response_carry_logprobs_only_when_asked():
    """A fake router answers three requests: one asking for top logprobs, one asking
    nothing, one asking logprobs that ends in an abort the router made (no logprobs)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    import zmq
    ctx = zmq.Context()
    router = Router(ctx, "127.0.0.1", port)
    try:
        with Client(f"127.0.0.1:{port}", timeout=10) as client:
            a = client.submit(input_ids=[1], sampling_params={"top_logprobs_num": 2}, rid="a")
            b = client.submit(input_ids=[1], rid="b")
            c = client.submit(input_ids=[1], sampling_params={"return_logprob": True}, rid="c")
            peer = None
            for _ in range(3):
                peer, _msg = router.recv(timeout=5)
            end = {"type": "length"}
            router.send(peer, p.Tokens.pack([
                p.TokenPart(a, [4, 5], ["v", "v"], None, {}, [-0.5, -1.0], [[(4, -0.5), (6, -2.0)],
                                                                            [(5, -1.0), (4, -1.5)]]),
                p.TokenPart(b, [7], ["v"])]))
            router.send(peer, p.Tokens.pack([
                p.TokenPart(a, [6], ["v"], end, {"text": None}, [-0.25], [[(6, -0.25), (1, -3.0)]]),
                p.TokenPart(b, [8], ["v"], end, {})]))
            router.send(peer, p.Tokens.abort(c, 503, "no live prefill and decode worker"))
            chunks = [client.receive() for _ in range(5)]
    finally:
        router.close()
        ctx.term()
    by_rid = {rid: [ch for ch in chunks if ch["rid"] == rid] for rid in (a, b, c)}
    assert by_rid[a][0]["logprobs"] == [-0.5, -1.0]
    assert by_rid[a][0]["top_logprobs"] == [[[4, -0.5], [6, -2.0]], [[5, -1.0], [4, -1.5]]]
    assert all("logprobs" not in ch and "top_logprobs" not in ch for ch in by_rid[b])
    assert by_rid[c][0]["logprobs"] == [] and "top_logprobs" not in by_rid[c][0]
    whole = assemble(by_rid[a])
    assert whole["output_token_logprobs"] == [-0.5, -1.0, -0.25]
    assert whole["output_top_logprobs"][2] == [[6, -0.25], [1, -3.0]]
    assert "output_token_logprobs" not in assemble(by_rid[b])
    assert assemble(by_rid[c])["output_token_logprobs"] == []
