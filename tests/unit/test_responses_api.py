"""POST /v1/responses (issue 46, item 5): the openai client's responses.create, whole and
streamed, and its responses.stream helper, against a front whose fake backend answers;
what the body becomes; what is refused by name."""
from __future__ import annotations

import pytest

from engines.formats.chat import ChatTemplate
from tests.unit.http_fake import FakeBackend, call, front, tiny_answer
from tests.unit.test_tool_calls import TOK, with_openai
from zpd.http.records import BadRequest
from zpd.http.responses_format import input_messages

openai = pytest.importorskip("openai")
TEXT = "Paris, of course."


def text_front(text: str = TEXT, finish: str = "stop"):
    ids = TOK.encode(text, add_special_tokens=False)
    backend = FakeBackend(lambda req, rid: tiny_answer(req, rid, ids, {"type": finish},
                                                       per_chunk=4))
    f = front(backend)
    f.chat = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", None, None)
    return f, backend


def test_the_openai_client_creates_a_response_whole_and_streamed():
    f, backend = text_front()

    async def use(client):
        whole = await client.responses.create(model="tiny", input="Capital of France?",
                                              instructions="Be brief.", max_output_tokens=32,
                                              temperature=0.5, top_p=0.9)
        events = [e async for e in await client.responses.create(
            model="tiny", input=[{"role": "user", "content": "Capital?"}], stream=True)]
        async with client.responses.stream(model="tiny", input="Capital?") as stream:
            deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
            final = await stream.get_final_response()
        return whole, events, deltas, final
    whole, events, deltas, final = with_openai(f, use)
    assert whole.object == "response" and whole.status == "completed" and whole.id.startswith("resp_")
    assert whole.output[0].content[0].text == TEXT and whole.output_text == TEXT
    assert whole.usage.output_tokens == len(TOK.encode(TEXT, add_special_tokens=False))
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 32
    req = backend.requests[0]
    assert req.messages == [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": "Capital of France?"}]
    assert req.sampling.max_new_tokens == 32 and req.sampling.temperature == 0.5
    assert req.sampling.top_p == 0.9
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    text = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(text) > 1 and "".join(text) == TEXT
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == TEXT and events[-1].response.usage.output_tokens > 0
    assert "".join(deltas) == TEXT and final.output_text == TEXT


def test_a_response_cut_at_max_output_tokens_is_incomplete():
    f, _ = text_front(finish="length")
    status, body = call(f, "POST", "/v1/responses", {"input": "x", "max_output_tokens": 5})
    assert status == 200 and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    status, events = call(f, "POST", "/v1/responses", {"input": "x", "stream": True})
    assert events[-1]["type"] == "response.incomplete" and "[DONE]" not in events


def test_input_items_and_refusals():
    assert input_messages([{"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "c"}]}], None) == [
        {"role": "system", "content": "a\nb"}, {"role": "assistant", "content": "c"}]
    for value, message in (([{"type": "function_call_output", "output": "x"}], "only messages"),
                           ([{"role": "user", "content": [{"type": "input_image"}]}], "only text"),
                           ([{"role": "robot", "content": "x"}], "role must be one of"),
                           ([], "non-empty list")):
        with pytest.raises(BadRequest, match=message):
            input_messages(value, None)
    f, _ = text_front()
    for body, message in (({"input": "x", "previous_response_id": "resp_1"}, "stores no responses"),
                          ({"input": "x", "tools": [{"type": "web_search"}]}, "'tools'"),
                          ({}, "'input' is required"),
                          ({"input": "x", "max_output_tokens": 0}, "max_output_tokens")):
        status, answer = call(f, "POST", "/v1/responses", body)
        assert status == 400 and message in answer["error"]["message"], answer
