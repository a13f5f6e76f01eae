"""OpenAI tool calls (issue 46, item 4): the tool-call readers on fixed text, whole and
streamed in every split; the forced-call grammar, checked by a grammar engine; the
chat body's tools, tool_choice and chat_template_kwargs; the template rendering them
as transformers' apply_chat_template does; and the wire shapes the real openai client
reads, whole and streamed, from a front whose backend answers with a call."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re

import openai
import pytest

from engines.formats.chat import ChatTemplate
from engines.models.tiny import EOS_ID, tiny_tokenizer
from engines.sampling_params import SamplingParams
from tests.unit.http_fake import FakeBackend, FrontServer, front, tiny_answer
from tests.unit.tool_fixtures import (CALL_ARGUMENTS, CALL_TEXT, NOOP, ROUND, TOOL_TEMPLATE,
                                      TOOLS, WEATHER)
from zpd.http.guard.plug import guarded_app
from zpd.http.openai_protocol import chat_messages, parse_chat
from zpd.http.records import BadRequest
from zpd.http.tool_calls import default_parser, forced_sampling, tool_request
from zpd.http.tool_grammar import forced_call_grammar
from zpd.http.tool_parsers import ToolCallReader

NAMES = {"get_weather", "noop"}
TOK = tiny_tokenizer()
HAS_GRAMMARS = "ebnf" in {f.name for f in dataclasses.fields(SamplingParams)}


def streamed(parser: str, text: str, seed: int) -> tuple[str, list[dict], list[dict]]:
    """(content, calls, deltas) of `text` fed in random pieces, as a stream reads it."""
    reader, rng, at = ToolCallReader(parser, NAMES), random.Random(seed), 0
    content, deltas = "", []
    while at < len(text):
        step = rng.randint(1, 6)
        c, d = reader.feed(text[at:at + step])
        content, deltas, at = content + c, deltas + d, at + step
    c, d = reader.finish()
    calls: dict[int, dict] = {}
    for delta in deltas + d:
        call = calls.setdefault(delta["index"], {"name": None, "arguments": ""})
        if "id" in delta:
            assert call["name"] is None and delta["type"] == "function"
            call["name"], call["id"] = delta["function"]["name"], delta["id"]
        call["arguments"] += delta["function"]["arguments"]
    return content + c, [calls[i] for i in sorted(calls)], deltas + d


# --- reading calls out of the text ----------------------------------------------------

HERMES_CASES = [
    (CALL_TEXT, "Let me look.", [("get_weather", CALL_ARGUMENTS)]),
    ('<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n<tool_call>\n'
     '{"arguments": {"city": "X"}, "name": "get_weather"}\n</tool_call>', None,
     [("noop", "{}"), ("get_weather", '{"city": "X"}')]),          # the second in another order
    ('no calls here  \n', "no calls here  \n", []),
    ('<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call> done',   # not a tool of ours
     '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call> done', []),
    ('a <tool_call>not json</tool_call> b <tool_ca', 'a <tool_call>not json</tool_call> b <tool_ca', []),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa',     # cut short (length)
     None, [("get_weather", '{"city": "Pa')]),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "}{\\"]"}}</tool_call>', None,
     [("get_weather", '{"city": "}{\\"]"}')]),                       # brackets inside strings
]


@pytest.mark.parametrize("text,content,calls", HERMES_CASES)
def test_hermes_calls_whole_and_streamed_in_every_split(text, content, calls):
    for parser in ("hermes", "qwen25"):
        got_content, got_calls = ToolCallReader(parser, NAMES).whole(text)
        assert got_content == content
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
        assert all(c["type"] == "function" and c["id"].startswith("call_") for c in got_calls)
        for seed in range(40):
            s_content, s_calls, _ = streamed(parser, text, seed)
            assert s_content == (content or "")
            assert [(c["name"], c["arguments"]) for c in s_calls] == calls


def test_arguments_stream_in_fragments_after_the_name():
    _, calls, deltas = streamed("hermes", CALL_TEXT, 0)
    assert deltas[0] == {"index": 0, "id": calls[0]["id"], "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}
    fragments = [d["function"]["arguments"] for d in deltas[1:]]
    assert len(fragments) > 3 and all(set(d) == {"index", "function"} for d in deltas[1:])
    assert "".join(fragments) == CALL_ARGUMENTS and json.loads(CALL_ARGUMENTS)["days"] == 3


LLAMA_CASES = [
    ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "X"}}; '
     '{"name": "noop", "parameters": {}}', None,
     [("get_weather", '{"city": "X"}'), ("noop", "{}")]),
    (' {"name": "noop", "parameters": {}}', None, [("noop", "{}")]),      # the tag skipped
    ('Hi {"name": "noop", "parameters": {}}', 'Hi {"name": "noop", "parameters": {}}', []),
    ('{"a": 1} is JSON', '{"a": 1} is JSON', []),
]


@pytest.mark.parametrize("text,content,calls", LLAMA_CASES)
def test_llama3_calls_whole_and_streamed(text, content, calls):
    got_content, got_calls = ToolCallReader("llama3", NAMES).whole(text)
    assert got_content == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in got_calls] == calls
    for seed in range(20):
        s_content, s_calls, _ = streamed("llama3", text, seed)
        assert s_content == (content or "") and [(c["name"], c["arguments"]) for c in s_calls] == calls


PIECES = ['<tool_call>', '</tool_call>', '<|python_tag|>', '{', '}', '[', ']', '"', '\\', ',',
          ':', ' ', '\n', ';', 'x', '"name"', '"arguments"', '"parameters"', '"noop"', '"nope"',
          '<tool', '_call>', '{"name": "noop", "parameters": {}}',
          '<tool_call>{"name": "noop", "arguments": {"a": "}"}}</tool_call>']


@pytest.mark.parametrize("parser", ["hermes", "llama3"])
def test_random_text_streams_as_it_reads_whole_and_text_without_calls_is_kept(parser):
    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 16)))
        content, calls = ToolCallReader(parser, NAMES).whole(text)
        if not calls:
            assert content == text
        for seed in range(2):
            s_content, s_calls, _ = streamed(parser, text, seed)
            assert s_content == (content or "")
            assert [(c["name"], c["arguments"]) for c in s_calls] == \
                [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_the_default_parser_is_what_the_template_writes():
    assert default_parser(TOOL_TEMPLATE) == "hermes"
    assert default_parser("{{ '<|python_tag|>' }}") == "llama3"
    assert default_parser("{{ messages }}") is None and default_parser(None) is None
    with pytest.raises(ValueError, match="unknown tool-call parser 'pythonic'"):
        ToolCallReader("pythonic", NAMES)


# --- the forced call's grammar --------------------------------------------------------

def test_forced_grammar_text_names_the_function_and_its_arguments():
    g = forced_call_grammar("hermes", [WEATHER], parallel=False)
    lines = g.splitlines()
    assert lines[0] == "root ::= call"
    assert lines[1] == ('call ::= ( "<tool_call>\\n{\\"name\\": \\"get_weather\\", '
                        '\\"arguments\\": " t0-args "}\\n</tool_call>" )')
    assert 't0-args ::= "{" ws t0-args-0f ws "}"' in lines
    assert 't0-args-0f ::= "\\"city\\"" ws ":" ws json-string ws t0-args-1c?' in lines
    assert 't0-args-1 ::= "\\"c\\"" | "\\"f\\""' in lines
    g = forced_call_grammar("llama3", TOOLS)
    assert g.startswith('root ::= call ( "; " call )*\ncall ::= ( "{\\"name\\": \\"get_weather\\", '
                        '\\"parameters\\": " t0-args "}" ) | ( "{\\"name\\": \\"noop\\", '
                        '\\"parameters\\": " "{}" "}" )\n')
    with pytest.raises(ValueError, match="no forced-call grammar"):
        forced_call_grammar("pythonic", TOOLS)


@pytest.fixture(scope="module")
def grammar_engine():
    """llguidance over the tiny byte tokenizer: does a grammar take a text whole?"""
    llguidance = pytest.importorskip("llguidance", reason="the test extra installs llguidance")
    import llguidance.hf
    import transformers
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=TOK.inner)
    lltok = llguidance.hf.from_tokenizer(hf, eos_token=EOS_ID)

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("ebnf", grammar))
        ids = TOK.encode(text, add_special_tokens=False)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    return accepts


def test_forced_grammar_takes_calls_by_the_schema_and_nothing_else(grammar_engine):
    one = forced_call_grammar("hermes", [WEATHER], parallel=False)
    call = '<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'
    for args in ('{"city": "Paris"}', '{"city": "P", "days": 3}', '{"city": "P", "unit": "f", "days": -2}',
                 '{ "city" : "P" ,"unit": "c" }'):
        assert grammar_engine(one, call % args), args
    for args in ('{"days": 3}', '{"city": 3}', '{"city": "P", "unit": "k"}',
                 '{"city": "P", "days": 1.5}', '{"city": "P", "other": 1}', '[]'):
        assert not grammar_engine(one, call % args), args
    assert not grammar_engine(one, "Sure! " + call % '{"city": "P"}')
    assert not grammar_engine(one, (call % '{"city": "P"}') * 2)     # one call, not parallel
    every = forced_call_grammar("hermes", TOOLS)
    noop = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert grammar_engine(every, call % '{"city": "P"}' + "\n" + noop)
    # a tool without parameters takes none (OpenAI: an empty parameter list)
    assert not grammar_engine(every, noop.replace("{}", '{"any": 1}'))
    assert not grammar_engine(every, noop.replace("noop", "nope"))
    llama = forced_call_grammar("llama3", TOOLS)
    assert grammar_engine(llama, '{"name": "get_weather", "parameters": {"city": "P"}}; '
                                 '{"name": "noop", "parameters": {}}')
    assert not grammar_engine(llama, '{"name": "get_weather", "parameters": {}}')


# --- the request ----------------------------------------------------------------------

def chat(**body) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}]} | body


def test_tools_go_to_the_template_and_choice_none_sends_none():
    req = parse_chat(chat(tools=TOOLS), tool_parser="hermes")
    (item,) = req.items
    assert item.chat_extra == {"tools": TOOLS} and req.tools.names == NAMES
    assert req.tools.parser == "hermes" and not req.tools.forced
    none = parse_chat(chat(tools=TOOLS, tool_choice="none"), tool_parser=None)
    assert none.items[0].chat_extra is None and none.tools is None


def test_tool_requests_refused_by_name():
    cases = [(chat(tools=TOOLS), None, "--tool-call-parser"),
             (chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}),
              "hermes", "'tool_choice' names the function 'x', which is not in 'tools'"),
             (chat(tool_choice="required"), "hermes", "needs 'tools'"),
             (chat(tools=TOOLS, tool_choice="always"), "hermes", "'tool_choice' must be"),
             (chat(tools=[{"type": "code_interpreter"}]), "hermes", "tools[0]: only"),
             (chat(tools=[WEATHER, WEATHER]), "hermes", "a second function named"),
             (chat(tools=[{"type": "function", "function": {"name": "a b"}}]), "hermes",
              "tools[0].function.name"),
             (chat(functions=[NOOP["function"]]), "hermes", "'functions' is not supported"),
             (chat(chat_template_kwargs={"messages": []}), "hermes", "set by the server"),
             (chat(chat_template_kwargs={"not a name": 1}), "hermes", "is not a name")]
    for body, parser, message in cases:
        with pytest.raises(BadRequest, match=re.escape(message)):
            parse_chat(body, tool_parser=parser)


def test_forced_calls_set_the_grammar():
    use, rendered, extra = tool_request(
        TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, "hermes")
    assert use.forced and rendered == TOOLS
    assert extra == {"ebnf": forced_call_grammar("hermes", [WEATHER], parallel=False)}
    _, _, extra = tool_request(TOOLS, "required", False, "hermes")
    assert extra == {"ebnf": forced_call_grammar("hermes", TOOLS, parallel=False)}
    with pytest.raises(BadRequest, match="cannot be combined with 'regex'"):
        forced_sampling({"regex": "a+"}, extra)
    # Until structured output is merged the engine has no `ebnf` field: a clear 400.
    body = chat(tools=TOOLS, tool_choice="required")
    if HAS_GRAMMARS:
        (item,) = parse_chat(body, tool_parser="hermes").items
        assert item.sampling.ebnf == forced_call_grammar("hermes", TOOLS)
    else:
        with pytest.raises(BadRequest, match="needs constrained decoding"):
            parse_chat(body, tool_parser="hermes")


def test_chat_template_kwargs_go_to_the_template():
    req = parse_chat(chat(chat_template_kwargs={"enable_thinking": False}, separate_reasoning=True))
    assert req.items[0].chat_extra == {"chat_template_kwargs": {"enable_thinking": False}}


def test_tool_turns_render_as_transformers_renders_them():
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=TOK.inner)
    messages = chat_messages(ROUND)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert messages[2] == {"role": "tool", "content": "21 C, sunny", "tool_call_id": "call_1"}
    template = ChatTemplate(TOOL_TEMPLATE, None, None)
    for tools, variables in ((TOOLS, {"enable_thinking": False}), (None, {}), (TOOLS, {})):
        ours = template.render(messages, tools=tools, variables=variables)
        theirs = hf.apply_chat_template(messages, tools=tools, chat_template=TOOL_TEMPLATE,
                                        add_generation_prompt=True, tokenize=False, **variables)
        assert ours == theirs
        assert ("<tools>" in ours) == (tools is not None)
        assert ("<think>" in ours) == ("enable_thinking" in variables)
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in ours
    with pytest.raises(ValueError, match="tools must be a list of objects"):
        template.render(messages, tools={"a": 1})


# --- the wire, read by the openai client ----------------------------------------------

def tool_front(text: str, finish: str = "stop", parser: str | None = None):
    ids = TOK.encode(text, add_special_tokens=False)
    backend = FakeBackend(lambda req, rid: tiny_answer(req, rid, ids, {"type": finish},
                                                       per_chunk=3))
    f = front(backend)
    f.chat = ChatTemplate(TOOL_TEMPLATE, None, None)
    if parser is not None:
        f.config = dataclasses.replace(f.config, tool_call_parser=parser)
    return f, backend


def with_openai(f, use):
    async def go():
        async with FrontServer(guarded_app(f, max_body_bytes=1 << 16)) as server:
            client = openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="none",
                                        max_retries=0)
            try:
                return await use(client)
            finally:
                await client.close()
    return asyncio.run(go())


def test_the_openai_client_reads_tool_calls_whole_and_streamed():
    f, backend = tool_front(CALL_TEXT)
    ask = {"model": "tiny", "messages": ROUND[:1], "tools": TOOLS}

    async def use(client):
        whole = await client.chat.completions.create(**ask)
        chunks = [c async for c in await client.chat.completions.create(**ask, stream=True)]
        return whole, chunks
    whole, chunks = with_openai(f, use)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me look."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and call.function.arguments == CALL_ARGUMENTS
    assert backend.requests[0].chat_extra == {"tools": TOOLS}
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    parts = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert content == "Let me look." and parts[0].id.startswith("call_")
    assert parts[0].function.name == "get_weather" and parts[0].type == "function"
    assert all(p.index == 0 for p in parts) and len(parts) > 2
    assert "".join(p.function.arguments or "" for p in parts) == CALL_ARGUMENTS
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_text_without_calls_and_calls_cut_short_keep_their_finish():
    f, _ = tool_front("Just text.", parser="hermes")

    async def plain(client):
        return await client.chat.completions.create(model="tiny", messages=ROUND[:1], tools=TOOLS)
    answer = with_openai(f, plain)
    assert answer.choices[0].message.content == "Just text."
    assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason == "stop"
    f, _ = tool_front(CALL_TEXT[:-20], finish="length")
    answer = with_openai(f, plain)
    assert answer.choices[0].finish_reason == "length"
    assert answer.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_a_front_without_a_parser_refuses_tools_by_name():
    f, _ = tool_front(CALL_TEXT)
    f.chat = ChatTemplate("{{ messages[0].content }}", None, None)

    async def use(client):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model="tiny", messages=ROUND[:1], tools=TOOLS)
        plain = await client.chat.completions.create(model="tiny", messages=ROUND[:1], tools=TOOLS,
                                                     tool_choice="none")
        return refused.value, plain
    refused, plain = with_openai(f, use)
    assert refused.status_code == 400 and "--tool-call-parser" in str(refused)
    assert plain.choices[0].message.content == CALL_TEXT     # not read for calls
