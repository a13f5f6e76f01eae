"""One HTTP call's prompt logprobs and its answer are bounded as a whole, not only per
field (issue 43, item 5: 64 prompts x 2,000 tokens with top 20 each made an 80 MB
answer and held every other caller's requests for 25 s)."""
from __future__ import annotations

import pytest

from tests.unit.http_fake import FakeBackend, call, front, tiny_answer
from zpd.config import HttpConfig
from zpd.http.native import parse_generate
from zpd.http.output import ENTRY_BYTES
from zpd.http.records import BadRequest, check_call_logprobs

SCORED = {"sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
          "logprob_start_len": 0, "top_logprobs_num": 5}


def test_the_issues_call_is_refused_by_default_naming_the_flag_and_the_figure():
    body = {"input_ids": [[7] * 2000] * 64} | SCORED | {"top_logprobs_num": 20}
    with pytest.raises(BadRequest) as got:
        check_call_logprobs(parse_generate(body).items, HttpConfig().max_call_logprobs)
    assert "--max-call-logprobs" in got.value.message and str(64 * 1999 * 21) in got.value.message


@pytest.mark.parametrize("path, body", [
    ("/generate", {"input_ids": [[7] * 100] * 4} | SCORED),
    ("/generate", {"input_ids": [7] * 100, "sampling_params": {"n": 4, "max_new_tokens": 0},
                   "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5}),
    ("/generate", {"text": "x" * 400} | SCORED),       # a text counts its bytes
    ("/v1/completions", {"prompt": [[7] * 100] * 4, "max_tokens": 0, "echo": True, "logprobs": 5}),
])
def test_a_call_past_max_call_logprobs_is_refused_before_the_router_hears_of_it(path, body):
    f = front(config=HttpConfig(max_call_logprobs=1000))
    status, answer = call(f, "POST", path, body)
    assert status == 400 and "--max-call-logprobs is 1000" in answer["error"]["message"], answer
    assert f.backend.requests == []


def test_a_call_within_the_bound_is_served():
    f = front(config=HttpConfig(max_call_logprobs=1000))
    status, _ = call(f, "POST", "/generate", {"input_ids": [7] * 100} | SCORED)    # 99 x 6
    assert status == 200 and len(f.backend.requests) == 1


def test_an_answer_past_max_answer_bytes_is_refused_and_its_requests_aborted():
    def long(req, rid):
        return tiny_answer(req, rid, [72, 105] * 500, per_chunk=10)      # 1,000 tokens each
    backend = FakeBackend(long)
    f = front(backend, config=HttpConfig(max_answer_bytes=1500 * ENTRY_BYTES))
    body = {"input_ids": [[1], [2], [3]], "sampling_params": {"max_new_tokens": 1000}}
    status, answer = call(f, "POST", "/generate", body)
    assert status == 400 and "--max-answer-bytes (48000)" in answer["error"]["message"], answer
    assert len(backend.closed) == 3                     # none had finished: all aborted
    status, answers = call(front(FakeBackend(long), config=HttpConfig(max_answer_bytes=1 << 20)),
                           "POST", "/generate", body)
    assert status == 200 and all(len(a["output_ids"]) == 1000 for a in answers)
