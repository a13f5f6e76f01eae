"""min_new_tokens (SGLang's): no EOS, stop token or stop string ends a request before
that many output tokens; the sampler may not draw an end token before then."""
from __future__ import annotations

import pytest
import torch

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request, StopChecker
from engines.sampler import Sampler, SamplingParams


@pytest.fixture(scope="module")
def tiny64():
    return load_model("tiny", dtype="float64")


def _run(model, prompts, params):
    engine = OfflineEngine(model)
    return engine.run([Request(f"r{i}", p, params) for i, p in enumerate(prompts)])


def test_no_eos_finish_before_min_new_tokens(tiny64):
    eos = tiny64.cfg.eos_token_ids[0]
    prompts = [[i] for i in range(40)]
    free = _run(tiny64, prompts, SamplingParams(temperature=0, max_new_tokens=30))
    early = [o for o in free if o["finish_reason"]["type"] == "stop" and len(o["output_ids"]) < 8]
    assert early, "the test needs prompts that end early by EOS"
    held = _run(tiny64, prompts, SamplingParams(temperature=0, max_new_tokens=30, min_new_tokens=8))
    for out in held:
        assert len(out["output_ids"]) >= 8, out
        assert eos not in out["output_ids"][:8]          # never drawn before the minimum


def test_stop_token_ids_wait_for_min_new_tokens(tiny64):
    (free,) = _run(tiny64, [[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=12,
                                                       ignore_eos=True))
    stop_at = free["output_ids"][1]
    (out,) = _run(tiny64, [[5, 6, 7]], SamplingParams(temperature=0, max_new_tokens=12,
                                                      ignore_eos=True, stop_token_ids=(stop_at,),
                                                      min_new_tokens=4))
    assert len(out["output_ids"]) >= 4 and stop_at not in out["output_ids"][:4]


def test_the_sampler_bans_end_tokens_until_the_minimum():
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0]], dtype=torch.float64)
    sampler = Sampler(eos_ids=(0,))
    p = SamplingParams(temperature=0, min_new_tokens=2, stop_token_ids=(3,))
    assert sampler(logits.clone(), [p], [1], [0], [[]], [[]]) == [1]     # 0 and 3 banned
    assert sampler(logits.clone(), [p], [1], [2], [[]], [[]]) == [0]     # minimum reached
    out = sampler.sample(logits.clone(), [SamplingParams(temperature=1.0, min_new_tokens=1,
                                                         return_logprob=True, top_logprobs_num=4)],
                         [7], [0], [[]], [[]])
    assert out.tokens[0] in (1, 2, 3) and out.top[0][-1][1] == float("-inf")


def test_a_stop_string_does_not_finish_before_the_minimum():
    class Chars:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)
    check = StopChecker((), Chars())
    req = Request("r", [1], SamplingParams(max_new_tokens=9, stop=("b",), min_new_tokens=3))
    req.output = [0, 1]
    assert check(req) is None
    req.output = [0, 1, 1]
    assert check(req) == {"type": "stop", "matched": "b"}


@pytest.mark.parametrize("raw", [{"min_new_tokens": -1}, {"min_new_tokens": True},
                                 {"min_new_tokens": 1.0}, {"min_new_tokens": 2 ** 40},
                                 {"min_new_tokens": 9, "max_new_tokens": 8}])
def test_min_new_tokens_out_of_bounds_is_refused_by_name(raw):
    with pytest.raises(ValueError, match="min_new_tokens"):
        SamplingParams.from_dict(raw)


def test_min_new_tokens_round_trips():
    p = SamplingParams.from_dict({"min_new_tokens": 8, "max_new_tokens": 8})
    assert SamplingParams.from_dict(p.to_dict()) == p
