"""The HTTP front's formatting, from hand-made chunks: incremental text, stop-string
hold-back, and logprobs in SGLang's and OpenAI's shapes (the chunk fields the engine's
logprobs bring: "logprobs" and "top_logprobs" per chunk)."""
from __future__ import annotations

import random

import pytest

from engines.models.tiny import tiny_tokenizer
from engines.sampling_params import SamplingParams
from tests.unit.http_fake import chunk
from zpd.http.native import engine_sampling, parse_generate
from zpd.http.native_format import native_answer
from zpd.http.openai_format import Answer, usage
from zpd.http.openai_protocol import chat_messages, completion_prompts, parse_chat, parse_completion
from zpd.http.output import Detokenizer, Output
from zpd.http.records import BadRequest, GenRequest

TOK = tiny_tokenizer()


def test_incremental_text_equals_a_whole_decode_and_never_shows_half_a_character():
    text = "héllo wörld, 日本語 ✓ ok"
    ids = TOK.encode(text, add_special_tokens=False)
    rng = random.Random(0)
    for _ in range(20):
        d, at = Detokenizer(TOK), 0
        while at < len(ids):
            step = rng.randint(1, 3)
            d.add(ids[at:at + step])
            at += step
            assert "\ufffd" not in d.text and text.startswith(d.text)
        assert d.text == text == d.whole()


def test_stop_strings_hold_back_text_until_they_cannot_match_and_the_final_text_wins():
    req = GenRequest(SamplingParams.from_dict({"stop": ["END"]}), input_ids=[1])
    out = Output(0, req, TOK)
    shown = ""
    for piece in "abcdEN":
        out.add(chunk("r", [ord(piece)]))
        shown += out.new_text()
        held = out.detok.text[:max(0, len(out.detok.text) - 2)]   # "EN" may start "END"
        assert out.text == held
    out.add(chunk("r", [ord("D")], {"type": "stop", "matched": "END"}, {}, "abcd"))
    shown += out.new_text()
    assert shown == out.text == "abcd"


def test_no_stop_trim_keeps_the_matched_stop_string():
    sp = engine_sampling({"stop": ["b"], "no_stop_trim": True, "n": 1,
                          "skip_special_tokens": True, "top_k": None})
    assert sp.engine == {"stop": ["b"]} and not sp.trim
    out = Output(0, GenRequest(SamplingParams.from_dict(sp.engine), input_ids=[1], trim_stop=sp.trim), TOK)
    out.add(chunk("r", [97, 98], {"type": "stop", "matched": "b"}, {}, "a"))
    assert out.text == "ab"


def logprob_chunks() -> list[dict]:
    return [chunk("r", [72], logprobs=[-0.5], top_logprobs=[[[72, -0.5], [73, -1.5]]]),
            chunk("r", [105, 33], {"type": "length"},
                  {"prompt_tokens": 2, "completion_tokens": 3, "retractions": 1}, "Hi!",
                  logprobs=[-0.25, -2.0], top_logprobs=[[[105, -0.25], [33, -3.0]],
                                                        [[33, -2.0], [72, -2.5]]])]


def test_native_answer_has_sglang_logprob_triples_and_weight_versions():
    req = GenRequest(SamplingParams.from_dict({"return_logprob": True, "top_logprobs_num": 2}), input_ids=[1, 2])
    out = Output(0, req, TOK)
    for c in logprob_chunks():
        out.add(c)
    a = native_answer(out)
    assert a["text"] == "Hi!" and a["output_ids"] == [72, 105, 33]
    m = a["meta_info"]
    assert m["output_token_logprobs"] == [[-0.5, 72, None], [-0.25, 105, None], [-2.0, 33, None]]
    assert m["output_top_logprobs"][2] == [[-2.0, 33, None], [-2.5, 72, None]]
    assert m["weight_version"] == "v1" and m["weight_versions"] == [
        {"version": "v1", "start": 0, "end": 3}]
    assert m["output_token_weight_versions"] == ["v1"] * 3
    assert m["retractions"] == 1 and m["prompt_tokens"] == 2 and m["completion_tokens"] == 3
    assert m["finish_reason"] == {"type": "length", "length": 3} and m["cached_tokens"] == 0
    assert type(m["e2e_latency"]) is float and 0 <= m["e2e_latency"] < 5
    assert set(m) == {"id", "finish_reason", "prompt_tokens", "completion_tokens",
                      "cached_tokens", "e2e_latency", "weight_version", "weight_versions",
                      "output_token_weight_versions", "retractions", "output_token_logprobs",
                      "output_top_logprobs"}
    assert native_answer(out, text_in_logprobs=True)["meta_info"]["output_token_logprobs"][0] == \
        [-0.5, 72, "H"]
    plain = Output(0, GenRequest(SamplingParams(), input_ids=[1]), TOK)
    plain.add(logprob_chunks()[1])
    assert "output_token_logprobs" not in native_answer(plain)["meta_info"]


def test_routed_experts_ask_and_answer():
    """The body's fields become the engine's (per prompt in a batch); the final chunk's
    routed experts are meta_info's, as SGLang's, and nothing else carries them."""
    gen = parse_generate({"input_ids": [[1], [2]], "return_routed_experts": [True, False],
                          "return_routed_expert_weights": True})
    assert [i.sampling.routing for i in gen.items] == ["weights", "weights"]
    assert parse_generate({"input_ids": [1], "return_routed_experts": True}).items[0] \
        .sampling.routing == "ids"
    assert parse_generate({"input_ids": [1]}).items[0].sampling.routing is None
    out = Output(0, GenRequest(SamplingParams(return_routed_experts=True), input_ids=[1, 2]), TOK)
    out.add(chunk("r", [72]))
    assert "routed_experts" not in native_answer(out)["meta_info"]
    out.add(chunk("r", [105], {"type": "length"}, {"routed_experts": "AAAA", "prompt_tokens": 2}))
    assert native_answer(out)["meta_info"]["routed_experts"] == "AAAA"


def test_openai_logprobs_completion_and_chat_shapes():
    req = GenRequest(SamplingParams.from_dict({"return_logprob": True, "top_logprobs_num": 1}), input_ids=[1, 2])
    out = Output(0, req, TOK)
    for c in logprob_chunks():
        out.add(c)
    whole = Answer("tiny", False, 1).whole([out], 1, ["Yo"])
    lp = whole["choices"][0]["logprobs"]
    assert whole["choices"][0]["text"] == "YoHi!"
    assert lp["tokens"] == ["H", "i", "!"] and lp["token_logprobs"] == [-0.5, -0.25, -2.0]
    assert lp["top_logprobs"][1] == {"i": -0.25, "!": -3.0} and lp["text_offset"] == [2, 3, 4]
    chat = Answer("tiny", True, 1).whole([out], 1)["choices"][0]
    assert chat["message"] == {"role": "assistant", "content": "Hi!"}
    first = chat["logprobs"]["content"][0]
    assert first["token"] == "H" and first["logprob"] == -0.5 and first["bytes"] == [72]
    assert first["top_logprobs"][1] == {"token": "I", "logprob": -1.5, "bytes": [73]}
    assert Answer("tiny", True, None).whole([out], 1)["choices"][0]["logprobs"] is None


def test_stream_chunk_logprobs_cover_only_the_new_tokens():
    req = GenRequest(SamplingParams.from_dict({"return_logprob": True, "top_logprobs_num": 0}), input_ids=[1, 2])
    out, answer = Output(0, req, TOK), Answer("tiny", False, 0)
    offsets = []
    for c in logprob_chunks():
        out.add(c)
        lp = answer.chunk(out, out.new_text(), out.new_tokens(), False)["choices"][0]["logprobs"]
        offsets += lp["text_offset"]
        assert lp["top_logprobs"] == [None] * len(c["token_ids"])
    assert offsets == [0, 1, 2]


def test_usage_counts_each_prompt_once_and_every_completion():
    outs = []
    for i in range(4):                              # 2 prompts x n=2
        o = Output(i, GenRequest(SamplingParams(), input_ids=[1] * (3 + i // 2)), TOK)
        o.add(chunk(f"r{i}", [72] * (i + 1), {"type": "length"},
                    {"prompt_tokens": 3 + i // 2, "completion_tokens": i + 1}, "H"))
        outs.append(o)
    assert usage(outs, 2) == {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17}


def test_n_copies_are_prompt_major_and_seeds_differ():
    req = parse_completion({"prompt": ["a", "b"], "n": 3, "seed": 7, "max_tokens": 2})
    assert [(i.text, i.sampling.to_wire()["seed"]) for i in req.items] == \
        [("a", 7), ("a", 8), ("a", 9), ("b", 7), ("b", 8), ("b", 9)]
    assert all(i.sampling.to_wire()["max_new_tokens"] == 2 for i in req.items)
    assert "seed" not in parse_completion({"prompt": "a", "n": 2}).items[0].sampling.to_wire()
    assert parse_completion({"prompt": "a"}).items[0].sampling.to_wire() == {"max_new_tokens": 16}


@pytest.mark.parametrize("body, words", [
    ({"prompt": "a", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": "3"}, "max_tokens"),
    ({"prompt": [1, -2]}, "prompt[1]"),
    ({"prompt": [1, 2 ** 31]}, "prompt[1]"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ["a", [1]]}, "mix"),
    ({"prompt": ""}, "empty"),
    ({}, "prompt"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "n": 0}, "'n'"),
    ({"prompt": "a", "logprobs": True}, "logprobs"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": "a", "stream_options": {"include_usage": 1}}, "include_usage"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "seed": 2 ** 63 - 1, "n": 2}, "seed"),
    ({"prompt": ["a"] * 600, "n": 2}, "more than 1024"),
])
def test_bad_completion_bodies_name_the_field(body, words):
    with pytest.raises(BadRequest) as e:
        parse_completion(body)
    assert words in e.value.message and e.value.status == 400


def test_chat_messages_take_text_parts_and_refuse_the_rest():
    assert chat_messages([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                       {"type": "text", "text": "b"}]}]) == \
        [{"role": "user", "content": "a\nb"}]
    for bad in ([], [{"role": "user"}], [{"role": 1, "content": "x"}], "hi",
                [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                [{"role": "assistant", "content": None, "tool_calls": [{"id": "x"}]}]):
        with pytest.raises(BadRequest):
            chat_messages(bad)
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                      "top_logprobs": 3, "max_completion_tokens": 5, "n": 2})
    assert req.logprobs == 3 and len(req.items) == 2
    assert req.items[0].sampling.to_wire() == {"max_new_tokens": 5, "return_logprob": True,
                                     "top_logprobs_num": 3}
    with pytest.raises(BadRequest):
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})
    with pytest.raises(BadRequest):
        parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [{"x": 1}]})


def test_completion_prompt_forms():
    assert completion_prompts("x") == [{"text": "x"}]
    assert completion_prompts([1, 2]) == [{"input_ids": [1, 2]}]
    assert completion_prompts(["x", "y"]) == [{"text": "x"}, {"text": "y"}]
    assert completion_prompts([[1], [2, 3]]) == [{"input_ids": [1]}, {"input_ids": [2, 3]}]


def test_native_bodies_as_slime_and_areal_send_them():
    slime = parse_generate({"input_ids": [1, 2, 3], "return_logprob": True, "sampling_params": {
        "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 8, "stop": None,
        "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
        "spaces_between_special_tokens": False}})
    item = slime.items[0]
    assert not slime.batch and item.logprobs and not item.trim_stop
    assert item.sampling == SamplingParams(max_new_tokens=8, return_logprob=True)
    areal = parse_generate({"input_ids": [5, 6], "sampling_params": {
        "top_p": 1.0, "top_k": 100000000, "max_new_tokens": 4, "temperature": 0.0,
        "stop_token_ids": [257], "frequency_penalty": 0.0}, "return_logprob": True,
        "stream": False})
    assert areal.items[0].sampling.to_wire()["stop_token_ids"] == [257]
    batch = parse_generate({"text": ["a", "b"], "rid": ["x", "y"],
                            "sampling_params": [{"max_new_tokens": 1}, None]})
    assert batch.batch and [i.rid for i in batch.items] == ["x", "y"]
    assert batch.items[1].sampling.to_wire() == {}


@pytest.mark.parametrize("body, words", [
    ({}, "exactly one"),
    ({"text": "a", "input_ids": [1]}, "exactly one"),
    ({"text": 5}, "text"),
    ({"text": ""}, "empty"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [1, "2"]}, "input_ids[1]"),
    ({"input_ids": [[1], []]}, "input_ids[1]"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -5}}, "max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"n": 0}}, "'n'"),
    ({"input_ids": [1], "sampling_params": {"n": True}}, "'n'"),
    ({"input_ids": [1], "sampling_params": {"n": 1025}}, "'n'"),
    ({"input_ids": [[1], [2]], "sampling_params": {"n": 600}}, "more than 1024"),
    ({"input_ids": [[1], [2]], "sampling_params": [{"n": 2}, {}]}, "same for every prompt"),
    ({"input_ids": [1], "sampling_params": {"n": 2, "seed": 2 ** 63 - 1}}, "seed"),
    ({"input_ids": [1], "sampling_params": [{}, {}]}, "2 entries for 1 prompt"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "2 prompts"),
    ({"text": ["a", "b"], "rid": ["x"]}, "rid"),
    ({"text": ["a", "b"], "rid": ["x", 3]}, "rid[1]"),
    ({"text": ["a", "b"], "rid": "x" * 255}, "at most 256"),
    ({"input_ids": [1], "rid": ["x"]}, "rid"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
    ({"text": ["a", "b"], "return_logprob": [True, 1]}, "return_logprob[1]"),
    ({"text": ["a", "b"], "top_logprobs_num": [1, 21]}, "top_logprobs_num[1]"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": 1}, "less than the prompt's length"),
    ({"input_ids": [1], "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"input_ids": [1], "return_logprob": True, "token_ids_logprob": [1.0]}, "token_ids_logprob[0]"),
    ({"input_ids": [1], "stream": "yes"}, "stream"),
    ({"input_ids": [1], "top_logprobs_num": 99}, "top_logprobs_num"),
    ({"input_ids": [1], "image_data": "x.png"}, "image_data"),
    ({"input_ids": [1], "rid": "x" * 300}, "at most 256"),
    ({"input_ids": [1], "rid": ""}, "rid"),
    ({"input_ids": [[1]] * 1025}, "more than 1024"),
    ({"input_ids": [1], "return_routed_experts": "yes"}, "return_routed_experts"),
    ({"input_ids": [1], "return_routed_expert_weights": 1}, "return_routed_expert_weights"),
    ({"text": ["a", "b"], "return_routed_experts": [True]}, "return_routed_experts"),
])
def test_bad_generate_bodies_name_the_field(body, words):
    with pytest.raises(BadRequest) as e:
        parse_generate(body)
    assert words in e.value.message
