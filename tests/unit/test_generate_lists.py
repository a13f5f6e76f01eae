"""/generate's per-item lists as SGLang's GenerateReqInput.normalize_batch_and_arguments
reads them: return_logprob, logprob_start_len, top_logprobs_num, token_ids_logprob (a
list per prompt), sampling_params and return_text_in_logprobs take one value for all
or one per prompt; a single prompt is a batch of one; a list with n > 1, or of the
wrong length, is a 400 naming the field."""
from __future__ import annotations

import pytest

from tests.unit.http_fake import FakeBackend, call, chunk, front
from zpd.http.native import parse_generate
from zpd.http.records import BadRequest

LISTS = {"return_logprob": [True, False], "logprob_start_len": [1, -1],
         "top_logprobs_num": [2, 0], "token_ids_logprob": [[7, 8], []],
         "return_text_in_logprobs": [True, False],
         "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 5, "temperature": 0}]}


def test_a_batch_takes_each_field_per_prompt():
    first, second = parse_generate({"input_ids": [[1, 2, 3], [4, 5]]} | LISTS).items
    assert first.logprobs and first.top_logprobs == 2 and first.token_ids_logprob == (7, 8)
    assert first.sampling.logprob_start_len == 1 and first.sampling.max_new_tokens == 3
    assert first.text_in_logprobs and not second.text_in_logprobs
    assert not second.logprobs and second.sampling.max_new_tokens == 5
    assert second.sampling.temperature == 0


def test_a_single_prompt_takes_a_list_of_one_as_its_value():
    """SGLang's `is_single` body with lists (what the list forms mean for one prompt:
    item 0 of a batch of one) equals the body with the values themselves."""
    lists = {k: v[:1] for k, v in LISTS.items()}
    values = {k: v[0] for k, v in LISTS.items()}
    (listed,), (plain,) = (parse_generate({"input_ids": [1, 2, 3]} | b).items
                           for b in (lists, values))
    assert listed.sampling == plain.sampling and listed.text_in_logprobs == plain.text_in_logprobs
    assert listed.sampling.top_logprobs_num == 2 and listed.text_in_logprobs
    assert not parse_generate({"input_ids": [1, 2, 3]} | lists).batch


def test_a_flat_token_ids_logprob_is_one_for_every_prompt():
    items = parse_generate({"input_ids": [[1], [2]], "return_logprob": True,
                            "token_ids_logprob": [7, 8]}).items
    assert [i.token_ids_logprob for i in items] == [(7, 8), (7, 8)]


@pytest.mark.parametrize("field", sorted(LISTS))
def test_a_list_of_the_wrong_length_names_the_field(field):
    with pytest.raises(BadRequest) as e:
        parse_generate({"input_ids": [[1, 2, 3], [4, 5], [6, 7]], field: LISTS[field]})
    assert f"'{field}' has 2 entries for 3 prompts" in e.value.message
    with pytest.raises(BadRequest) as e:
        parse_generate({"input_ids": [1, 2, 3], field: LISTS[field]})
    assert e.value.message.endswith(f"'{field}' has 2 entries for 1 prompt")


@pytest.mark.parametrize("field", sorted(set(LISTS) - {"sampling_params"}))
def test_a_list_with_n_above_one_is_refused_as_sglang_does(field):
    with pytest.raises(BadRequest) as e:
        parse_generate({"input_ids": [[1, 2, 3], [4, 5]], "sampling_params": {"n": 2},
                        field: LISTS[field]})
    assert f"'{field}' cannot be a list with 'sampling_params.n' 2 > 1" in e.value.message


def test_sampling_params_per_prompt_hold_for_each_copy():
    items = parse_generate({"input_ids": [[1], [2]], "sampling_params": [
        {"n": 2, "max_new_tokens": 3}, {"n": 2, "max_new_tokens": 5}]}).items
    assert [i.sampling.max_new_tokens for i in items] == [3, 5, 3, 5]      # copy-major


def test_text_in_logprobs_per_prompt_over_http():
    """The wire shape: a batch whose return_text_in_logprobs is a list (400 before)."""
    backend = FakeBackend(lambda req, rid: [chunk(rid, [72], {"type": "length"},
                                                  {"prompt_tokens": 1}, "H", logprobs=[-0.5])])
    status, got = call(front(backend), "POST", "/generate", {
        "input_ids": [[1], [2]], "return_logprob": True,
        "return_text_in_logprobs": [True, False]})
    assert status == 200, got
    assert [a["meta_info"]["output_token_logprobs"] for a in got] == [[[-0.5, 72, "H"]],
                                                                      [[-0.5, 72, None]]]
    status, got = call(front(backend), "POST", "/generate", {
        "text": "a", "return_logprob": [True], "return_text_in_logprobs": [True],
        "sampling_params": [{"max_new_tokens": 1}]})
    assert status == 200 and got["meta_info"]["output_token_logprobs"] == [[-0.5, 72, "H"]]
    status, got = call(front(backend), "POST", "/generate", {
        "input_ids": [[1], [2]], "return_text_in_logprobs": [True]})
    assert status == 400 and "'return_text_in_logprobs' has 1 entries for 2" in got["error"]["message"]
