"""Sampler masks, penalty arithmetic and seed reproducibility, against hand-computed values."""
from __future__ import annotations

import math

import pytest
import torch

from engines.sampler import Sampler, SamplingParams, apply_penalties, filter_probs

LOGITS = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]], dtype=torch.float64)


def _probs(logits, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0):
    v = logits.shape[1]
    probs, ids = filter_probs(logits, torch.tensor([temperature], dtype=logits.dtype),
                              torch.tensor([top_k or v]), torch.tensor([top_p], dtype=logits.dtype),
                              torch.tensor([min_p], dtype=logits.dtype))
    out = torch.zeros_like(probs)
    return out.scatter_(1, ids, probs)[0]


def _softmax(values):
    e = [math.exp(x) for x in values]
    return [x / sum(e) for x in e]


def test_top_k_keeps_k_best():
    p = _probs(LOGITS, top_k=2)
    expect = _softmax([2.0, 1.0])
    assert p.tolist() == pytest.approx([expect[0], expect[1], 0, 0, 0])


def test_top_p_keeps_smallest_set_reaching_p():
    full = _softmax(LOGITS[0].tolist())        # in vocab order: 2.0, 1.0, 0.5, -1.0, 0.0
    # the two best hold 0.77 < 0.8, so the third (0.5) is needed too
    assert full[0] + full[1] < 0.8 < full[0] + full[1] + full[2]
    p = _probs(LOGITS, top_p=0.8)
    kept = full[:3]
    assert p.tolist() == pytest.approx([k / sum(kept) for k in kept] + [0, 0])


def test_top_p_always_keeps_the_best_token():
    assert _probs(LOGITS, top_p=0.01).tolist() == pytest.approx([1, 0, 0, 0, 0])


def test_min_p_drops_tokens_below_fraction_of_best():
    full = _softmax(LOGITS[0].tolist())
    p = _probs(LOGITS, min_p=0.3)               # keep prob >= 0.3 * p_max
    kept = [x if x >= 0.3 * full[0] else 0 for x in full]
    assert p.tolist() == pytest.approx([k / sum(kept) for k in kept])


def test_temperature_scales_logits():
    p = _probs(LOGITS, temperature=0.5)
    assert p.tolist() == pytest.approx(_softmax([2 * x for x in LOGITS[0].tolist()]))


def test_repetition_penalty_divides_positive_multiplies_negative():
    out = apply_penalties(LOGITS[0].clone(), SamplingParams(repetition_penalty=2.0), [0], [3])
    assert out.tolist() == [1.0, 1.0, 0.5, -2.0, 0.0]


def test_frequency_and_presence_penalties_count_output_only():
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = apply_penalties(LOGITS[0].clone(), p, [1, 1, 1], [2, 2, 4])
    assert out.tolist() == [2.0, 1.0, 0.5 - 2 * 0.5 - 0.25, -1.0, 0.0 - 0.5 - 0.25]


def test_greedy_ignores_seed_and_takes_argmax():
    tokens = Sampler()(LOGITS.clone(), [SamplingParams(temperature=0)], [1], [0], [[]], [[]])
    assert tokens == [0]


def _draws(params, seed, steps):
    g = torch.Generator().manual_seed(123)
    logits = torch.randn(3, 50, generator=g, dtype=torch.float64)
    sampler, out = Sampler(), []
    for step in range(steps):
        rows = len(params)
        tokens = sampler(logits[:rows].clone(), params, [seed] * rows, [step] * rows,
                         [[]] * rows, [[]] * rows)
        out.append(tokens[0])
    return out


def test_same_seed_same_tokens_whatever_the_neighbours():
    p = SamplingParams(temperature=1.0, seed=42)
    alone = _draws([p], 42, 20)
    other = SamplingParams(temperature=0.7, top_k=5)
    with_neighbours = _draws([p, other, other], 42, 20)
    assert alone == with_neighbours
    assert _draws([p], 43, 20) != alone


def test_sampling_follows_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64))
    sampler, counts = Sampler(), [0, 0, 0]
    for step in range(3000):
        counts[sampler(logits.clone(), [SamplingParams()], [9], [step], [[]], [[]])[0]] += 1
    # deterministic seeds: this is a fixed sample, tolerances are ~4 sigma
    assert counts[0] / 3000 == pytest.approx(0.5, abs=0.04)
    assert counts[1] / 3000 == pytest.approx(0.3, abs=0.04)


def test_top_k_one_is_greedy_when_sampling():
    logits = torch.randn(4, 30, dtype=torch.float64)
    params = [SamplingParams(temperature=1.3, top_k=1)] * 4
    assert Sampler()(logits.clone(), params, [1, 2, 3, 4], [0] * 4, [[]] * 4, [[]] * 4) == \
        logits.argmax(-1).tolist()


@pytest.mark.parametrize("bad", [
    {"temperature": -1}, {"top_p": 0}, {"top_k": -2}, {"min_p": 2}, {"max_new_tokens": -1},
    {"repetition_penalty": 0}, {"frequency_penalty": 3}, {"nonsense": 1}, {"stop": [""]},
    {"seed": "x"}, {"max_new_tokens": 1.5}])
def test_bad_params_are_clear_errors(bad):
    with pytest.raises(ValueError):
        SamplingParams.from_dict(bad)


def test_params_round_trip():
    p = SamplingParams.from_dict({"stop": "x", "stop_token_ids": [3], "seed": 5, "top_k": 4})
    assert SamplingParams.from_dict(p.to_dict()) == p


# Each value here once reached the sampler and raised there, killing the worker
# (issue #11, finding 4): temperature and top_p that round to 0 in float32, a top_k
# past int64, a penalty that overflows the logits.
@pytest.mark.parametrize("name,value", [
    ("temperature", 1e-300), ("temperature", 1e-6), ("temperature", 101), ("temperature", float("inf")),
    ("temperature", float("nan")), ("temperature", True), ("temperature", False), ("temperature", "1"),
    ("top_p", 1e-320), ("top_p", 1e-7), ("top_p", float("nan")), ("top_p", 1.0000001),
    ("top_k", 2**63), ("top_k", 2**31), ("top_k", True), ("top_k", 1.0),
    ("min_p", -0.1), ("min_p", float("nan")),
    ("repetition_penalty", 1e-300), ("repetition_penalty", 1e300), ("repetition_penalty", float("inf")),
    ("frequency_penalty", float("-inf")), ("presence_penalty", float("nan")),
    ("max_new_tokens", 2**31), ("max_new_tokens", True),
    pytest.param("max_new_tokens", 10**400, id="max_new_tokens-10**400"),
    ("seed", 2**63), ("seed", -2**63 - 1), ("seed", 1.5), ("seed", False),
    ("stop", ["x"] * 65), ("stop", ["x" * 257]), ("stop", [3]), ("stop", 1.5), ("stop", {"a": 1}),
    ("stop_token_ids", [-1]), ("stop_token_ids", [2**31]), ("stop_token_ids", [True]),
    ("stop_token_ids", list(range(1025))), ("stop_token_ids", "12"),
    ("ignore_eos", "yes"), ("ignore_eos", 1)])
def test_out_of_bounds_params_are_refused_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        SamplingParams.from_dict({name: value})


@pytest.mark.parametrize("raw", [None, {}, {"temperature": 0}, {"temperature": 1e-5},
                                 {"temperature": 100}, {"top_k": 0}, {"top_k": -1}])
def test_params_at_the_bounds_are_accepted(raw):
    SamplingParams.from_dict(raw)


@pytest.mark.parametrize("raw", [[("temperature", 0)], "temperature", 3])
def test_sampling_params_must_be_an_object(raw):
    with pytest.raises(ValueError, match="sampling"):
        SamplingParams.from_dict(raw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("edge", [
    {"temperature": 1e-5}, {"temperature": 100}, {"top_p": 1e-6}, {"top_k": 2**31 - 1},
    {"min_p": 1.0}, {"repetition_penalty": 0.01}, {"repetition_penalty": 100},
    {"frequency_penalty": -2, "presence_penalty": 2}, {"seed": -2**63}, {"seed": 2**63 - 1}])
def test_every_accepted_edge_samples_a_token(edge, dtype):
    """The bounds are where the sampler's arithmetic still holds in the narrowest dtype."""
    logits = (torch.randn(2, 64, generator=torch.Generator().manual_seed(0)) * 30).to(dtype)
    p = SamplingParams.from_dict({"temperature": 1.0} | edge)
    tokens = Sampler()(logits, [p, p], [1, 2], [0, 3], [[1, 2]] * 2, [[3, 3, 4]] * 2)
    assert all(0 <= t < 64 for t in tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_penalties_leave_the_models_inference_tensor_alone(dtype):
    """The runner's logits are inference tensors, which may not be written outside
    inference mode: a penalty on a float32/float64 model used to raise here."""
    with torch.inference_mode():
        logits = LOGITS.to(dtype).clone()
    p = SamplingParams(temperature=0, repetition_penalty=4.0)
    assert Sampler()(logits, [p], [1], [0], [[0]], [[]]) == [1]       # 2.0 / 4 < 1.0
    assert logits.tolist() == LOGITS.tolist()


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(top_p=0.999)])
def test_a_token_without_probability_is_never_drawn(params):
    """Both draws (vocabulary order without filters, sorted with them): -inf logits,
    including the last ones, whose ids a uniform near 1 would reach by rounding."""
    logits = torch.tensor([[0.0, float("-inf"), 3.0, float("-inf"), float("-inf")]])
    sampler = Sampler()
    drawn = {sampler(logits.clone(), [params], [seed], [0], [[]], [[]])[0] for seed in range(400)}
    assert drawn == {0, 2}
