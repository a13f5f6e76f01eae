"""What one HTTP call may ask for, checked at the front before anything reaches the
router: the cluster's prompt caps, the generations one call may start; how a
/generate stream's events are written: SGLang's --incremental-streaming-output, and
the spacing of cumulative events."""
from __future__ import annotations

import orjson
import pytest

from tests.unit.http_fake import FakeBackend, chunk, call, front
from zpd.config import HttpConfig, PromptLimits
from zpd.http.native import parse_generate
from zpd.http.openai_protocol import parse_chat, parse_completion
from zpd.http.records import BadRequest

SMALL = HttpConfig(prompt_limits=PromptLimits(max_text_bytes=100, max_input_ids=10))
CHAT = [{"role": "user", "content": "x" * 200}]


@pytest.mark.parametrize("path,body,flag", [
    ("/generate", {"text": "x" * 101}, "--max-text-bytes"),
    ("/generate", {"text": "é" * 51}, "--max-text-bytes"),            # 102 bytes of UTF-8
    ("/generate", {"text": ["ok", "x" * 101]}, "text[1]"),
    ("/generate", {"input_ids": list(range(11))}, "--max-input-ids"),
    ("/generate", {"input_ids": [[1], list(range(11))]}, "input_ids[1]"),
    ("/generate", {"text": "x" * 101, "sampling_params": {"n": 4}}, "--max-text-bytes"),
    ("/v1/completions", {"prompt": "x" * 101}, "--max-text-bytes"),
    ("/v1/completions", {"prompt": ["a", "x" * 101], "n": 2}, "prompt[1]"),
    ("/v1/completions", {"prompt": list(range(11))}, "--max-input-ids"),
    ("/v1/chat/completions", {"messages": CHAT}, "--max-text-bytes"),
])
def test_an_over_limit_prompt_is_refused_by_the_front_naming_the_flag(path, body, flag):
    f = front(config=SMALL)
    status, answer = call(f, "POST", path, body)
    assert status == 400 and flag in answer["error"]["message"], answer
    assert f.backend.requests == []                       # nothing reached the router


def test_prompts_within_the_caps_pass_and_the_defaults_are_the_clusters():
    f = front(config=SMALL)
    assert call(f, "POST", "/generate", {"text": "x" * 100})[0] == 200
    assert call(f, "POST", "/generate", {"input_ids": list(range(10))})[0] == 200
    # The defaults are the router's and the workers' (PromptLimits): a 20 MB text or
    # 5M token ids would exceed the router's frame limit, so the front refuses them.
    with pytest.raises(BadRequest, match="--max-text-bytes"):
        parse_generate({"text": "x" * (20 << 20)})
    with pytest.raises(BadRequest, match="--max-input-ids"):
        parse_completion({"prompt": [1] * ((1 << 20) + 1)})
    with pytest.raises(BadRequest, match="--max-text-bytes"):
        parse_chat({"messages": [{"role": "user", "content": "x" * ((1 << 20) + 1)}]})


@pytest.mark.parametrize("path,body", [
    ("/generate", {"text": ["a"] * 8, "sampling_params": {"n": 3}}),
    ("/generate", {"input_ids": [1], "sampling_params": {"n": 17}}),
    ("/generate", {"input_ids": [[1]] * 17}),
    ("/v1/completions", {"prompt": ["a", "b", "c"], "n": 6}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 17}),
])
def test_one_call_may_start_at_most_max_batch_requests_generations(path, body):
    f = front(config=HttpConfig(max_batch_requests=16))
    status, answer = call(f, "POST", path, body)
    assert status == 400 and "--max-batch-requests" in answer["error"]["message"], answer
    assert f.backend.requests == []
    assert call(f, "POST", "/generate", {"input_ids": [1], "sampling_params": {"n": 16}})[0] == 200


def test_n_above_the_old_constant_is_allowed_when_the_cap_allows_it():
    req = parse_generate({"input_ids": [1], "sampling_params": {"n": 2000}},
                         HttpConfig(max_batch_requests=4096))
    assert len(req.items) == 2000


@pytest.mark.parametrize("value", [True, False, 1.0, 2.0, "2", [2]])
@pytest.mark.parametrize("where", ["n", "max_new_tokens", "top_k", "min_new_tokens", "seed"])
def test_integer_sampling_fields_refuse_booleans_and_floats(where, value):
    # OpenAI's and SGLang's clients send JSON integers; a boolean or a float is refused
    # (1.0 included), as the fuzz tests pin for token ids.
    with pytest.raises(BadRequest, match=where):
        parse_generate({"input_ids": [1], "sampling_params": {where: value}})


@pytest.mark.parametrize("body", [
    {"prompt": "a", "n": True}, {"prompt": "a", "n": 1.0}, {"prompt": "a", "max_tokens": 2.0},
    {"prompt": "a", "logprobs": True}, {"prompt": "a", "best_of": 1.0},
    {"prompt": "a", "min_tokens": True}, {"prompt": "a", "top_k": 1.0},
])
def test_openai_integer_fields_refuse_booleans_and_floats(body):
    with pytest.raises(BadRequest):
        parse_completion(body)


def logprob_script(req, rid):
    """Three tokens, one per chunk, each with its logprob and one top alternative."""
    ids = [72, 105, 33]
    out = []
    for i, t in enumerate(ids):
        final = i == len(ids) - 1
        c = chunk(rid, [t], {"type": "length"} if final else None,
                  {"prompt_tokens": 1, "completion_tokens": 3} if final else None,
                  "Hi!" if final else None, version=f"v{i // 2}",
                  logprobs=[-0.5 * i], top_logprobs=[[[t, -0.5 * i]]])
        out.append(c)
    return out


STREAM_LOGPROBS = {"input_ids": [1], "stream": True, "return_logprob": True,
                   "top_logprobs_num": 1}


def test_incremental_streaming_output_sends_only_what_is_new():
    f = front(FakeBackend(logprob_script), config=HttpConfig(incremental_streaming_output=True))
    status, events = call(f, "POST", "/generate", STREAM_LOGPROBS)
    assert status == 200 and events[-1] == "[DONE]"
    events = events[:-1]
    assert [e["output_ids"] for e in events] == [[72], [105], [33]]
    assert "".join(e["text"] for e in events) == "Hi!"
    metas = [e["meta_info"] for e in events]
    assert [m["output_token_logprobs"] for m in metas] == \
        [[[0.0, 72, None]], [[-0.5, 105, None]], [[-1.0, 33, None]]]
    assert [m["output_top_logprobs"] for m in metas] == \
        [[[[0.0, 72, None]]], [[[-0.5, 105, None]]], [[[-1.0, 33, None]]]]
    assert [m["output_token_weight_versions"] for m in metas] == [["v0"], ["v0"], ["v1"]]
    assert metas[2]["weight_versions"] == [{"version": "v1", "start": 2, "end": 3}]
    assert [m["completion_tokens"] for m in metas] == [1, 2, 3]     # counts stay whole
    assert metas[-1]["finish_reason"] == {"type": "length", "length": 3}


def test_cumulative_streaming_is_still_the_default():
    f = front(FakeBackend(logprob_script))
    status, events = call(f, "POST", "/generate", STREAM_LOGPROBS)
    assert [e["output_ids"] for e in events[:-1]] == [[72], [72, 105], [72, 105, 33]]
    triples = [[0.0, 72, None], [-0.5, 105, None], [-1.0, 33, None]]
    assert [e["meta_info"]["output_token_logprobs"] for e in events[:-1]] == \
        [triples[:1], triples[:2], triples]
    assert [e["meta_info"]["output_top_logprobs"] for e in events[:-1]] == \
        [[[t] for t in triples[:k]] for k in (1, 2, 3)]
    assert events[-2]["meta_info"]["weight_versions"] == [
        {"version": "v0", "start": 0, "end": 2}, {"version": "v1", "start": 2, "end": 3}]


def long_script(tokens: int, top: int):
    def script(req, rid):
        out = []
        for i in range(tokens):
            final = i == tokens - 1
            t = 65 + i % 26
            out.append(chunk(rid, [t], {"type": "length"} if final else None,
                             {"completion_tokens": tokens} if final else None, None,
                             logprobs=[-0.5], top_logprobs=[[[t + k, -1.0 - k]
                                                             for k in range(top)]]))
        return out
    return script


def test_cumulative_events_are_spaced_so_a_stream_writes_linear_bytes():
    # One cumulative event per token would write 400^2 / 2 token entries (~40 MB here,
    # GBs at 4,000 tokens); spaced, the stream writes about the budget per token.
    tokens, budget = 400, 2048
    f = front(FakeBackend(long_script(tokens, 20)),
              config=HttpConfig(cumulative_bytes_per_token=budget))
    status, events = call(f, "POST", "/generate", STREAM_LOGPROBS | {"top_logprobs_num": 20})
    assert status == 200 and events[-1] == "[DONE]"
    events = events[:-1]
    final = events[-1]
    assert len(final["output_ids"]) == tokens and final["meta_info"]["finish_reason"]["type"] \
        == "length"
    assert len(final["meta_info"]["output_top_logprobs"]) == tokens
    lengths = [len(e["output_ids"]) for e in events]
    assert lengths == sorted(set(lengths)) and lengths[0] == 1     # each the state so far
    assert all(e["output_ids"] == final["output_ids"][:len(e["output_ids"])] for e in events)
    total = sum(len(orjson.dumps(e)) for e in events)
    assert total <= budget * tokens + 2 * len(orjson.dumps(final)), total
    assert len(events) < tokens / 4


def test_the_front_flags_reach_its_config_and_launch_hands_them_on():
    from zpd.ops.cli import build_parser
    from zpd.ops.http_options import HTTP_PASSTHROUGH, http_config
    from zpd.ops.options import passthrough_argv
    args = build_parser().parse_args([
        "http", "--model", "tiny", "--max-text-bytes", "1000", "--max-input-ids", "50",
        "--max-batch-requests", "8", "--incremental-streaming-output",
        "--cumulative-bytes-per-token", "99", "--stream-write-timeout", "2.5",
        "--stream-buffer-bytes", "4096"])
    cfg = http_config(args)
    assert cfg.prompt_limits == PromptLimits(max_text_bytes=1000, max_input_ids=50)
    assert (cfg.max_batch_requests, cfg.incremental_streaming_output,
            cfg.cumulative_bytes_per_token,
            cfg.stream_write_timeout, cfg.stream_buffer_bytes) == (8, True, 99, 2.5, 4096)
    launch = build_parser().parse_args([
        "launch", "--model", "tiny", "--max-text-bytes", "1000", "--stream-write-timeout", "3",
        "--incremental-streaming-output"])
    argv = passthrough_argv(launch, HTTP_PASSTHROUGH)
    assert argv[argv.index("--max-text-bytes") + 1] == "1000"
    assert argv[argv.index("--stream-write-timeout") + 1] == "3.0"
    assert "--incremental-streaming-output" in argv


@pytest.mark.parametrize("flag,value", [("--stream-write-timeout", "0"),
                                        ("--max-batch-requests", "0"),
                                        ("--stream-buffer-bytes", "-1"),
                                        ("--cumulative-bytes-per-token", "0")])
def test_front_flags_that_cannot_work_are_refused_at_start(flag, value):
    from zpd.ops.cli import build_parser
    from zpd.ops.http_options import http_config
    args = build_parser().parse_args(["http", "--model", "tiny", flag, value])
    with pytest.raises(ValueError, match=flag):
        http_config(args)
