"""Structured output's fields on the HTTP front (zpd/http/structured.py): what reaches
the engine for /generate's regex, json_schema and ebnf, SGLang's frontend's regexes,
OpenAI's response_format on chat and completions; a grammar that cannot compile, or
two at once, is a 400 naming the field before any worker sees it."""
from __future__ import annotations

import json

import pytest

from engines.formats.chat import ChatTemplate
from engines.models.tiny import tiny_tokenizer
from tests.unit.http_fake import FakeBackend, call
from zpd.http.front import Front
from zpd.http.structured import ANY_OBJECT

CHAT = {"messages": [{"role": "user", "content": "hi"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
# sglang.lang's gen(dtype=int / float / bool / str) sends these (sglang/lang/ir.py)
SGL_REGEXES = [r"[-+]?[0-9]+[ \n]*", r"[-+]?[0-9]*\.?[0-9]+[ \n]*", r"(True|False)",
               r"\"[\w\d\s]*\""]


def front() -> Front:
    """The fake front, with a chat template (the tiny model has none)."""
    chat = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", None, None)
    return Front(FakeBackend(), "tiny", tiny_tokenizer(), chat, "")


def sent(f) -> dict:
    return f.backend.requests[-1].sampling.to_wire()


@pytest.mark.parametrize("field, text", [("regex", r) for r in SGL_REGEXES] + [
    ("json_schema", json.dumps(SCHEMA)), ("json_schema", "$$ANY$$"),
    ("ebnf", 'root ::= "yes" | "no"'), ("ebnf", 'start: "a"+')])
def test_generate_sends_the_grammar_to_the_engine(field, text):
    f = front()
    body = {"text": "hi", "sampling_params": {field: text, "regex": None} | {field: text}}
    status, _ = call(f, "POST", "/generate", body)
    assert status == 200 and sent(f)[field] == text


@pytest.mark.parametrize("path, body, want", [
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_object"}}, ANY_OBJECT),
    ("/v1/chat/completions", CHAT | {"response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     json.dumps(SCHEMA)),
    ("/v1/completions", {"prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}, json.dumps(SCHEMA)),
    ("/v1/completions", {"prompt": "a", "json_schema": json.dumps(SCHEMA)}, json.dumps(SCHEMA)),
])
def test_openai_response_format_is_a_json_schema(path, body, want):
    f = front()
    status, _ = call(f, "POST", path, body)
    assert status == 200 and sent(f)["json_schema"] == want
    assert call(f, "POST", path, body | {"response_format": {"type": "text"}, "json_schema": None})[0] == 200
    assert "json_schema" not in sent(f)


@pytest.mark.parametrize("path, body, named", [
    ("/generate", {"text": "a", "sampling_params": {"regex": "((("}}, "'sampling_params.regex' does not compile"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": "{x"}}, "'sampling_params.json_schema' is not JSON"),
    ("/generate", {"text": "a", "sampling_params": {"json_schema": '{"type": "nope"}'}},
     "'sampling_params.json_schema' does not compile"),
    ("/generate", {"text": "a", "sampling_params": {"ebnf": "root ::= nothing"}},
     "'sampling_params.ebnf' does not compile"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}},
     "only one of 'sampling_params.regex', 'sampling_params.json_schema'"),
    ("/generate", {"text": "a", "sampling_params": {"regex": 5}}, "sampling_params.regex"),
    ("/generate", {"text": "a", "sampling_params": {"structural_tag": "x"}}, "'sampling_params.structural_tag'"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "nope"}}}}, "'response_format.json_schema.schema' does not compile"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "json_schema"}}, "'response_format.json_schema'"),
    ("/v1/chat/completions", CHAT | {"response_format": {"type": "yaml"}}, "'response_format.type'"),
    ("/v1/chat/completions", CHAT | {"response_format": "json"}, "response_format"),
    ("/v1/completions", {"prompt": "a", "regex": "a", "response_format": {"type": "json_object"}},
     "only one of 'regex', 'response_format'"),
])
def test_a_bad_or_second_grammar_is_a_400_naming_the_field(path, body, named):
    f = front()
    status, got = call(f, "POST", path, body)
    message = got["error"]["message"] if "error" in got else str(got)
    assert status == 400 and named in message, message
    assert not f.backend.requests
