"""SGLang's field lists (zpd/http/sglang_fields.py) through the HTTP front: every
ignored field accepted, every refused one answered 400 naming it when its value asks
for something, unknown names warned once and never forwarded; sampling_params.n,
skip_special_tokens, min_new_tokens, and meta_info in SGLang's shape."""
from __future__ import annotations

import logging

import pytest

from engines.sampling_params import SamplingParams
from tests.unit.http_fake import FakeBackend, call, chunk, front, tiny_answer
from zpd.http.native import parse_generate
from zpd.http.openai_protocol import parse_chat, parse_completion
from zpd.http.output import version_spans
from zpd.http.records import BadRequest
from zpd.http import bodies
from zpd.http.sglang_fields import (CHAT, COMPLETION, GENERATE, IGNORED, IMPLEMENTED, REFUSED,
                                    SAMPLING, UnknownFields)

CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}]}
BASES = {"generate": ({"input_ids": [1, 2]}, GENERATE, parse_generate),
         "sampling": ({"input_ids": [1, 2]}, SAMPLING, parse_generate),
         "completion": ({"prompt": "a"}, COMPLETION, parse_completion),
         "chat": (CHAT_BODY, CHAT, parse_chat)}
# values that ask for something, whatever the field (a refused field must refuse them all)
ASKING = [True, "x", {"a": 1}, [1], 2]


def _body(where: str, name: str, value):
    base, _, parse = BASES[where]
    if where == "sampling":
        return base | {"sampling_params": {name: value}}, parse
    return base | {name: value}, parse


def _cases(kind: str) -> list:
    return [pytest.param(where, name, id=f"{where}.{name}")
            for where, (_, table, _) in BASES.items()
            for name, rule in table.items() if rule.kind == kind]


@pytest.mark.parametrize("where, name", _cases(IGNORED))
def test_every_ignored_field_is_accepted_and_not_forwarded(where, name):
    for value in (None, False, True, "x", 0, {"k": "v"}, ["a"]):
        body, parse = _body(where, name, value)
        req = parse(body)
        assert all(name not in item.sampling.to_wire() for item in req.items), (name, value)


@pytest.mark.parametrize("where, name", _cases(REFUSED))
def test_every_refused_field_asking_for_a_feature_is_a_400_naming_it(where, name):
    rule = BASES[where][1][name]
    for value in ASKING:
        if any(type(v) is type(i) and v == i for i in rule.idle
               for v in (value if type(value) is list else [value])):
            continue                                   # what the rule calls idle
        body, parse = _body(where, name, value)
        with pytest.raises(BadRequest) as e:
            parse(body)
        assert f"{name}' is not supported" in e.value.message and e.value.status == 400, value
    for value in (None, False, "", [], {}, [None, None]) + rule.idle:
        body, parse = _body(where, name, value)
        assert all(name not in item.sampling.to_wire() for item in parse(body).items)


def test_the_defaults_sglang_router_sends_are_accepted():
    f = front()
    gen = {"input_ids": [1, 2], "model": "tiny", "return_bytes": False, "stream": False,
           "return_hidden_states": False, "log_metrics": True, "rid": "a"}
    assert call(f, "POST", "/generate", gen)[0] == 200
    comp = {"prompt": "a", "model": "tiny", "no_stop_trim": False, "return_hidden_states": False,
            "ignore_eos": False, "skip_special_tokens": True, "stop_token_ids": None}
    assert call(f, "POST", "/v1/completions", comp)[0] == 200
    chat = CHAT_BODY | {"model": "tiny", "no_stop_trim": False, "return_hidden_states": False,
                        "continue_final_message": False, "separate_reasoning": True,
                        "stream_reasoning": True, "skip_special_tokens": True,
                        "tool_choice": "none", "chat_template_kwargs": None}
    assert len(parse_chat(chat).items) == 1
    assert f.backend.requests[0].sampling.to_wire() == {}
    assert f.backend.requests[1].sampling == SamplingParams(max_new_tokens=16, ignore_eos=False)


def test_unknown_names_are_warned_once_and_never_reach_the_router(caplog):
    f = front()
    body = {"input_ids": [1], "mystery": 1, "sampling_params": {"max_new_tokens": 2, "odd": 3}}
    with caplog.at_level(logging.WARNING, logger="zpd.http.fields"):
        for _ in range(3):
            assert call(f, "POST", "/generate", body)[0] == 200
        assert call(f, "POST", "/v1/completions", {"prompt": "a", "mystery": 1})[0] == 200
    lines = [r.getMessage() for r in caplog.records if r.name == "zpd.http.fields"]
    assert sum("'mystery'" in m for m in lines) == 2         # once per route
    assert sum("'sampling_params.odd'" in m for m in lines) == 1
    assert all(r.sampling.to_wire() == {"max_new_tokens": 2} for r in f.backend.requests[:3])
    assert parse_completion({"prompt": "a", "stream_options": {"nope": 1}, "zz": 2}).unknown == \
        ("zz", "stream_options.nope")
    assert parse_chat(CHAT_BODY | {"zz": 1}).unknown == ("zz",)


def test_unknown_names_remembered_are_bounded(caplog):
    seen = UnknownFields(limit=4)
    with caplog.at_level(logging.WARNING, logger="zpd.http.fields"):
        seen.note([f"n{i}" for i in range(100)], "/generate")
        seen.note(["n0", "n99"], "/generate")
    assert len(seen.seen) == 4 and len(caplog.records) == 5       # 4 names + "no longer"


def test_n_fans_out_copy_major_with_seeds_and_rids():
    f = front()
    status, body = call(f, "POST", "/generate", {"input_ids": [1, 2], "rid": "q", "sampling_params": {
        "n": 3, "sampling_seed": 5, "max_new_tokens": 3}})
    assert status == 200 and type(body) is list and len(body) == 3
    assert [r.sampling.to_wire()["seed"] for r in f.backend.requests] == [5, 6, 7]
    # the router sees each rid under its caller's name (zpd/http/guard/callers.py)
    assert [r.rid.rpartition(":")[2] for r in f.backend.requests] == ["q_0", "q_1", "q_2"]
    assert [b["meta_info"]["id"] for b in body] == ["q_0", "q_1", "q_2"]
    req = parse_generate({"text": ["a", "b"], "rid": ["x", "y"], "sampling_params": {"n": 2}})
    assert [(i.text, i.rid) for i in req.items] == [("a", "x_0"), ("b", "y_0"), ("a", "x_1"),
                                                    ("b", "y_1")]
    assert not parse_generate({"input_ids": [1], "sampling_params": {"n": 1}}).batch


def test_per_prompt_logprob_lists():
    req = parse_generate({"input_ids": [[1], [2]], "return_logprob": [True, False],
                          "top_logprobs_num": [2, 0]})
    assert [(i.logprobs, i.top_logprobs) for i in req.items] == [(True, 2), (False, 0)]
    with pytest.raises(BadRequest, match="return_logprob"):
        parse_generate({"input_ids": [[1], [2]], "return_logprob": [True, False],
                        "sampling_params": {"n": 2}})


def test_min_new_tokens_reaches_the_engine_and_is_checked():
    f = front()
    assert call(f, "POST", "/generate", {"input_ids": [1], "sampling_params": {
        "min_new_tokens": 4, "max_new_tokens": 8}})[0] == 200
    assert f.backend.requests[-1].sampling.to_wire() == {"min_new_tokens": 4, "max_new_tokens": 8}
    assert call(f, "POST", "/v1/completions", {"prompt": "a", "min_tokens": 3})[0] == 200
    assert f.backend.requests[-1].sampling.to_wire() == {"max_new_tokens": 16, "min_new_tokens": 3}
    for bad in ({"min_new_tokens": -1}, {"min_new_tokens": 9, "max_new_tokens": 8},
                {"min_new_tokens": "2"}):
        status, body = call(f, "POST", "/generate", {"input_ids": [1], "sampling_params": bad})
        assert status == 400 and "min_new_tokens" in body["error"]["message"]
    assert parse_generate({"input_ids": [1], "sampling_params": {
        "min_new_tokens": 0}}).items[0].sampling.to_wire() == {}


def _smollm_front(smollm, ids: list[int], matched: int):
    def script(req, rid):
        text = smollm.decode(ids[:-1])            # the workers' text: skipped, trimmed
        meta = {"prompt_tokens": 1, "completion_tokens": len(ids), "cached_tokens": 1}
        return [chunk(rid, [t]) for t in ids[:-1]] + [
            chunk(rid, ids[-1:], {"type": "stop", "matched": matched}, meta, text)]
    return front(FakeBackend(script)).__class__(FakeBackend(script), "smollm2", smollm)


def test_skip_special_tokens_false_keeps_them_in_the_text(smollm):
    end, start = smollm.token_to_id("<|im_end|>"), smollm.token_to_id("<|im_start|>")
    ids = smollm.encode("Hi", False) + [start] + smollm.encode(" there", False) + [end]
    f = _smollm_front(smollm, ids, end)
    def text(sampling, stream=False):
        status, got = call(f, "POST", "/generate", {"input_ids": [1], "stream": stream,
                                                    "sampling_params": sampling})
        assert status == 200
        if not stream:
            return got["text"]
        texts = [e["text"] for e in got[:-1]]
        assert all(texts[-1].startswith(t) for t in texts)      # each a prefix of the end
        return texts[-1]
    assert text({}) == "Hi there"
    keep = {"skip_special_tokens": False, "no_stop_trim": True,
            "spaces_between_special_tokens": False}
    for stream in (False, True):
        assert text(keep, stream) == "Hi<|im_start|> there<|im_end|>"
        assert text({"skip_special_tokens": False}, stream) == "Hi<|im_start|> there"
    status, body = call(f, "POST", "/v1/completions", {"prompt": [1], "skip_special_tokens": False,
                                                       "no_stop_trim": True})
    assert status == 200 and body["choices"][0]["text"] == "Hi<|im_start|> there<|im_end|>"
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 1}


def test_meta_info_in_sglangs_shape():
    def script(req, rid):
        out = tiny_answer(req, rid, [72, 105, 33, 33], per_chunk=1)
        for c, v in zip(out, ["a", "a", "b", "a"]):
            c["weight_versions"] = [v]
        out[-1]["meta"]["cached_tokens"] = 2
        return out
    status, body = call(front(FakeBackend(script)), "POST", "/generate", {"input_ids": [1, 2]})
    m = body["meta_info"]
    assert status == 200 and m["weight_version"] == "a" and m["cached_tokens"] == 2
    assert m["weight_versions"] == [{"version": "a", "start": 0, "end": 2},
                                    {"version": "b", "start": 2, "end": 3},
                                    {"version": "a", "start": 3, "end": 4}]
    assert m["output_token_weight_versions"] == ["a", "a", "b", "a"]
    assert m["finish_reason"] == {"type": "length", "length": 4}
    assert type(m["e2e_latency"]) is float and m["e2e_latency"] > 0
    assert version_spans([]) == []


@pytest.mark.parametrize("status, err_type", [(400, "BadRequestError"), (499, None),
                                              (500, "InternalServerError"),
                                              (503, "ServiceUnavailableError"),
                                              (504, "TimeoutError")])
def test_an_abort_finish_carries_sglangs_err_type(status, err_type):
    abort = {"type": "abort", "status_code": status, "message": "gone"}
    f = front(FakeBackend(lambda req, rid: tiny_answer(req, rid, [72], abort)))
    got, body = call(f, "POST", "/generate", {"input_ids": [1]})
    assert got == 200 and body["meta_info"]["finish_reason"] == abort | {"err_type": err_type}


def test_a_matched_stop_token_leaves_the_text_unless_no_stop_trim():
    stop = {"type": "stop", "matched": 33}                 # "!": a plain token, not special
    f = front(FakeBackend(lambda req, rid: tiny_answer(req, rid, [72, 105, 33], stop)))
    for stream in (False, True):
        for trim, text in ((True, "Hi"), (False, "Hi!")):
            status, got = call(f, "POST", "/generate", {"input_ids": [1], "stream": stream,
                                                        "sampling_params": {"no_stop_trim": not trim}})
            last = got[-2] if stream else got
            assert status == 200 and last["text"] == text and last["output_ids"] == [72, 105, 33]


@pytest.mark.parametrize("table, model", [(GENERATE, bodies.Generate), (SAMPLING, bodies.Sampling),
                                          (COMPLETION, bodies.Completion), (CHAT, bodies.Chat)])
def test_the_implemented_fields_are_the_models_fields(table, model):
    implemented = {name for name, rule in table.items() if rule.kind == IMPLEMENTED}
    assert implemented == set(model.__struct_fields__)
