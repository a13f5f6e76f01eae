"""/v1/completions with `echo` and `logprobs` (the prompt's tokens and their logprobs
lead each choice, position 0's null) and `max_tokens: 0` with `echo` (a scoring
request), as vLLM serves them: what goes to the workers, the answer's shape over
fake workers, and the values through the real in-process cluster, also with the
openai client."""
from __future__ import annotations

import asyncio

import openai
import pytest

from engines.models.tiny import tiny_tokenizer
from engines.sampling_params import SamplingParams
from tests.unit.http_fake import FakeBackend, FrontServer, call, chunk, front
from tests.unit.inproc import InprocCluster
from zpd.http.guard.plug import guarded_app
from zpd.http.openai_protocol import parse_completion
from zpd.http.records import GenRequest

TOK = tiny_tokenizer()
PROMPT = list(b"The quick brown fox jumps over the lazy dog")      # the tiny model's ids: bytes
TEXT = "The quick brown fox jumps over the lazy dog"
LOGPROBS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def scored_answer(req: GenRequest, rid: str) -> list[dict]:
    """What the workers send for a 3-token prompt [72, 105, 33] ("Hi!") asked for its
    logprobs: two output tokens "ok", then the prompt's in the final meta."""
    meta = {"prompt_tokens": 3, "completion_tokens": 2, "retractions": 0,
            "input_token_logprobs": [[None, 72], [-1.5, 105], [-0.25, 33]],
            "input_top_logprobs": [None, [[105, -1.5], [33, -2.0]], [[33, -0.25], [72, -3.0]]]}
    return [chunk(rid, [111], logprobs=[-0.5], top_logprobs=[[[111, -0.5], [72, -1.0]]]),
            chunk(rid, [107], {"type": "length"}, meta, "ok", logprobs=[-0.75],
                  top_logprobs=[[[107, -0.75], [33, -1.25]]])]


# --- what goes to the workers ------------------------------------------------------

def test_echo_with_logprobs_asks_the_workers_for_the_prompts_from_position_0():
    (item,) = parse_completion({"prompt": [1, 2], "echo": True, "logprobs": 3}).items
    assert item.sampling.to_wire() == {"max_new_tokens": 16, "return_logprob": True,
                             "top_logprobs_num": 3, "logprob_start_len": 0}
    (plain,) = parse_completion({"prompt": [1, 2], "logprobs": 3}).items
    assert "logprob_start_len" not in plain.sampling.to_wire() and plain.sampling.to_wire()["top_logprobs_num"] == 3
    (echo,) = parse_completion({"prompt": [1, 2], "echo": True}).items
    assert echo.sampling.to_wire() == {"max_new_tokens": 16}          # no logprobs: none asked


def test_max_tokens_0_with_echo_is_a_scoring_request():
    req = parse_completion({"prompt": ["a", "b"], "echo": True, "max_tokens": 0, "logprobs": 0})
    assert [i.sampling for i in req.items] == [SamplingParams(
        max_new_tokens=0, return_logprob=True, top_logprobs_num=0, logprob_start_len=0)] * 2
    assert req.echo and req.logprobs == 0


@pytest.mark.parametrize("body, status, words", [
    ({"prompt": [1], "max_tokens": 0}, 400, "'max_tokens' must be at least 1 unless \"echo\": true"),
    ({"prompt": [1], "max_tokens": 0, "echo": False, "logprobs": 1}, 400, "'max_tokens' must be"),
    ({"prompt": [1], "max_tokens": -1, "echo": True}, 400, "'max_tokens' must be an integer in [0,"),
    ({"prompt": [1], "echo": "yes", "logprobs": 1}, 400, "'echo' must be true or false"),
    ({"prompt": [1], "echo": True, "logprobs": 21}, 400, "'logprobs' must be an integer in [0, 20]"),
    ({"prompt": [1], "echo": True, "logprobs": True}, 400, "'logprobs' must be an integer"),
    ({"prompt": [1], "echo": True, "max_tokens": 0, "min_tokens": 1}, 400, "min_new_tokens"),
    ({"prompt": [1], "echo": True, "suffix": "x"}, 400, "'suffix' is not supported"),
])
def test_bad_combinations_are_400_naming_the_field(body, status, words):
    f = front()
    got, answer = call(f, "POST", "/v1/completions", body)
    assert got == status and words in answer["error"]["message"], answer
    assert f.backend.requests == []                         # nothing reached the router


# --- the answer's shape --------------------------------------------------------------

@pytest.mark.parametrize("prompt", [[72, 105, 33], "Hi!"])
def test_the_prompts_tokens_lead_the_logprobs_first_null(prompt):
    f = front(FakeBackend(scored_answer))
    status, body = call(f, "POST", "/v1/completions",
                        {"prompt": prompt, "echo": True, "logprobs": 2, "max_tokens": 2})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["text"] == "Hi!ok" and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["H", "i", "!", "o", "k"]
    assert lp["token_logprobs"] == [None, -1.5, -0.25, -0.5, -0.75]
    assert lp["top_logprobs"] == [None, {"i": -1.5, "!": -2.0}, {"!": -0.25, "H": -3.0},
                                  {"o": -0.5, "H": -1.0}, {"k": -0.75, "!": -1.25}]
    assert lp["text_offset"] == [0, 1, 2, 3, 4]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    # without echo the same answer covers the completion alone
    status, plain = call(f, "POST", "/v1/completions", {"prompt": [72, 105, 33], "logprobs": 2})
    assert plain["choices"][0]["logprobs"]["tokens"] == ["o", "k"]
    assert plain["choices"][0]["logprobs"]["text_offset"] == [0, 1]


def test_a_stream_sends_the_echo_with_the_prompts_logprobs_in_one_chunk_per_choice():
    """The workers send the prompt's logprobs with the last token, so each choice
    waits for its end and comes whole: the echo, then the completion, in order."""
    f = front(FakeBackend(scored_answer))
    body = {"prompt": [72, 105, 33], "echo": True, "logprobs": 2, "n": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    status, events = call(f, "POST", "/v1/completions", body)
    assert status == 200 and events[-1] == "[DONE]"
    chunks, usage = events[:-2], events[-2]
    assert sorted(e["choices"][0]["index"] for e in chunks) == [0, 1]
    _, whole = call(f, "POST", "/v1/completions", body | {"stream": False, "stream_options": None})
    for e in chunks:
        c = e["choices"][0]
        assert c == whole["choices"][c["index"]]
    assert usage["usage"] == whole["usage"] and usage["choices"] == []


def test_an_abort_mid_stream_ends_the_choice_with_its_error():
    """No prompt logprobs came (the request failed): the one chunk has the echo and
    the completion's tokens, and the error."""
    lost = {"type": "abort", "status_code": 503, "message": "decode 1 is unavailable"}
    f = front(FakeBackend(lambda req, rid: [
        chunk(rid, [111], logprobs=[-0.5], top_logprobs=[[[111, -0.5]]]),
        chunk(rid, [], lost, {"prompt_tokens": 3, "completion_tokens": 1})]))
    status, events = call(f, "POST", "/v1/completions",
                          {"prompt": [72, 105, 33], "echo": True, "logprobs": 1, "stream": True})
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 2
    c = events[0]["choices"][0]
    assert c["text"] == "Hi!o" and c["finish_reason"] == "abort" and c["error"]["code"] == 503
    assert c["logprobs"]["tokens"] == ["o"] and c["logprobs"]["text_offset"] == [3]
    status, body = call(f, "POST", "/v1/completions",
                        {"prompt": [72, 105, 33], "echo": True, "logprobs": 1})
    assert status == 503 and "unavailable" in body["error"]["message"]


def test_echo_without_logprobs_streams_as_before():
    f = front(FakeBackend(scored_answer))
    status, events = call(f, "POST", "/v1/completions",
                          {"prompt": [72, 105, 33], "echo": True, "stream": True})
    texts = [e["choices"][0]["text"] for e in events[:-1]]
    assert texts == ["Hi!o", "k"] and all(e["choices"][0]["logprobs"] is None for e in events[:-1])


# --- through the real cluster ---------------------------------------------------------

def cluster_script(c: InprocCluster):
    """A FakeBackend script that runs each request on the in-process cluster and hands
    its answer on as the router client does: a chunk per token, the last one with the
    finish reason, the final meta and the workers' text."""
    def script(req: GenRequest, rid: str) -> list[dict]:
        got = c.run(c.submit(req.input_ids, sampling=req.sampling))
        parts = []
        for i, t in enumerate(got.token_ids):
            lps = {} if got.logprobs is None else {"logprobs": got.logprobs[i:i + 1]}
            tops = {} if got.top_logprobs is None else {"top_logprobs": got.top_logprobs[i:i + 1]}
            parts.append(chunk(rid, [t], version=got.weight_versions[i], **lps, **tops))
        last = parts.pop() if parts else chunk(rid, [])
        return parts + [last | {"finished": True, "finish_reason": got.finish, "meta": got.meta,
                                "text": TOK.decode(got.token_ids)}]
    return script


@pytest.fixture
def served(cluster):
    """The HTTP front over the in-process cluster."""
    yield front(FakeBackend(cluster_script(cluster)))
    cluster.check_pages()


def _generate_prompt_logprobs(f, top: int) -> dict:
    """/generate's meta_info for PROMPT: its input_token_logprobs (and tops), greedy."""
    status, body = call(f, "POST", "/generate", {
        "input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": top})
    assert status == 200, body
    return body["meta_info"]


def _expected_prompt_part(meta: dict) -> dict:
    """/generate's prompt triples as the legacy lists (texts by the tokenizer)."""
    texts = [TOK.token_text(t) for _, t, _ in meta["input_token_logprobs"]]
    return {"tokens": texts, "token_logprobs": [v for v, _, _ in meta["input_token_logprobs"]],
            "top_logprobs": [None if row is None else {TOK.token_text(t): v for v, t, _ in row}
                             for row in meta["input_top_logprobs"]]}


def test_echo_logprobs_equal_generates_input_token_logprobs(served):
    meta = _generate_prompt_logprobs(served, 2)
    status, body = call(served, "POST", "/v1/completions", {
        "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0})
    assert status == 200, body
    (choice,) = body["choices"]
    lp, want, n = choice["logprobs"], _expected_prompt_part(meta), len(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert {k: lp[k][:n] for k in want} == want
    assert all(type(v) is float for v in lp["token_logprobs"][1:])
    assert lp["token_logprobs"][n:] == [v for v, _, _ in meta["output_token_logprobs"]]
    assert choice["text"] == TEXT + TOK.decode([t for _, t, _ in meta["output_token_logprobs"]])
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [sum(map(len, lp["tokens"][:i])) for i in range(n + 3)]
    # the same prompt again: its logprobs are computed, not served from the prefix cache
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3,
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_max_tokens_0_with_echo_scores_the_prompt(served, cluster):
    meta = _generate_prompt_logprobs(served, 1)
    status, body = call(served, "POST", "/v1/completions", {
        "prompt": PROMPT, "echo": True, "logprobs": 1, "max_tokens": 0})
    assert status == 200, body
    (choice,) = body["choices"]
    assert choice["text"] == TEXT and choice["finish_reason"] == "length"
    assert {k: choice["logprobs"][k] for k in ("tokens", "token_logprobs", "top_logprobs")} == \
        _expected_prompt_part(meta)
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 0,
                             "total_tokens": len(PROMPT), "prompt_tokens_details": {"cached_tokens": 0}}
    # without logprobs it still echoes the prompt and generates nothing
    status, bare = call(served, "POST", "/v1/completions",
                        {"prompt": PROMPT, "echo": True, "max_tokens": 0})
    assert bare["choices"][0]["text"] == TEXT and bare["choices"][0]["logprobs"] is None
    assert bare["usage"]["completion_tokens"] == 0
    # streamed, with or without logprobs: one chunk, the whole answer's choice
    for ask in ({"logprobs": 1}, {}):
        whole = body if ask else bare
        status, events = call(served, "POST", "/v1/completions", {
            "prompt": PROMPT, "echo": True, "max_tokens": 0, "stream": True} | ask)
        assert len(events) == 2 and events[0]["choices"] == whole["choices"]


def test_a_stream_through_the_cluster_equals_the_whole_answer(served):
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 4, "temperature": 0}
    _, whole = call(served, "POST", "/v1/completions", body)
    status, events = call(served, "POST", "/v1/completions", body | {"stream": True})
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 2
    assert events[0]["choices"] == whole["choices"]
    assert whole["choices"][0]["logprobs"]["token_logprobs"][0] is None
    assert len(whole["choices"][0]["logprobs"]["tokens"]) == len(PROMPT) + 4


def with_openai(f, use):
    """`use(client)`'s result: openai's own AsyncOpenAI client, over HTTP, against the
    front `f`."""
    async def go():
        async with FrontServer(guarded_app(f, max_body_bytes=1 << 16)) as server:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="none",
                                        max_retries=0)
            try:
                return await use(client)
            finally:
                await client.close()
    return asyncio.run(go())


def test_the_openai_client_reads_echoed_logprobs(served):
    async def use(client):
        ask = {"model": "tiny", "prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 2,
               "temperature": 0}
        whole = await client.completions.create(**ask)
        chunks = [c async for c in await client.completions.create(**ask, stream=True)]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
        return whole, chunks, refused.value
    whole, chunks, refused = with_openai(served, use)
    (choice,) = whole.choices
    lp, n = choice.logprobs, len(PROMPT)
    assert choice.text.startswith(TEXT) and len(lp.tokens) == n + 2
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])
    assert lp.top_logprobs[0] is None and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert whole.usage.completion_tokens == 2 and whole.usage.prompt_tokens == n
    (streamed,) = chunks
    assert streamed.choices[0].text == choice.text
    assert streamed.choices[0].logprobs.token_logprobs == lp.token_logprobs
    assert refused.status_code == 400 and "'max_tokens' must be at least 1" in str(refused)


def test_the_openai_client_scores_a_prompt(served):
    async def use(client):
        return await client.completions.create(model="tiny", prompt=PROMPT, echo=True,
                                               logprobs=1, max_tokens=0)
    scored = with_openai(served, use)
    (choice,) = scored.choices
    assert choice.text == TEXT and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and len(lp.tokens) == len(PROMPT)
    assert all(v < 0 for v in lp.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(PROMPT)
