"""Logprobs: the engine's against an independent reference."""
from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engines.kv_pool import KVLayout, KVPool
from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request, as_float32
from engines.runner import ModelRunner
from engines.sampler import SamplingParams, token_logprobs

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
    assert token_logprobs(logits, [plain] * 3, [0, 1, 2]) == ([None] * 3, [None] * 3)
    assert rows == []
    lps, tops = token_logprobs(logits, [plain, asking, plain], [0, 1, 2])
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
