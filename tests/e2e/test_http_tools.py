"""Issue 46 through a real cluster (`zpd launch --http-port`, 1P1D, the tiny GGUF model),
with the real openai client: tools, tool results and chat_template_kwargs rendered by
the workers' chat template, given to `zpd launch` as 5 kB of template text; answers
read for tool calls, whole and streamed; and /v1/responses, whole and streamed.

The tiny model's greedy text is what it is (no tool calls): each answer is checked
against `zpd run`'s greedy tokens for the same rendered prompt, read by the same
reader. The wire shapes of calls are checked on fixed text in tests/unit."""
from __future__ import annotations

import json

import pytest

from engines.formats.overrides import ModelOverrides
from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.e2e.cluster import Cluster
from tests.unit.gguf_files import write_tiny_gguf
from tests.unit.tool_fixtures import ROUND, TOOL_TEMPLATE, TOOLS
from zpd.http.openai_protocol import chat_messages
from zpd.http.tool_parsers import ToolCallReader

pytest.importorskip("mooncake.engine", reason="needs mooncake-transfer-engine(-non-cuda)")
openai = pytest.importorskip("openai", reason="the test extra installs the openai client")

# 5 kB of template text on the command line (item 5): once failed with "File name too long"
TEMPLATE = "{#- " + "padding " * 640 + "#}\n" + TOOL_TEMPLATE
N = 12


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return str(write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf"))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, gguf):
    assert len(TEMPLATE) > 5000
    with Cluster(tmp_path_factory.mktemp("tools"), model=gguf,
                 extra=("--http-port", "0", "--chat-template", TEMPLATE)) as c:
        yield c


@pytest.fixture(scope="module")
def oai(cluster):
    return openai.OpenAI(base_url=f"http://{cluster.info['http']}/v1", api_key="none",
                         max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(gguf):
    return load_model(gguf, dtype="float64", overrides=ModelOverrides(chat_template=TEMPLATE))


def expected(reference, messages, tools=None, variables=None) -> tuple[int, str]:
    """(prompt tokens, greedy text) as `zpd run` has them for this conversation."""
    ids = reference.encode_chat(chat_messages(messages), tools, variables)
    (out,) = OfflineEngine(reference).run([Request("ref", ids, SamplingParams(
        temperature=0, max_new_tokens=N, ignore_eos=True))])
    return len(ids), out["text"]


def test_tools_and_tool_turns_render_on_the_workers(oai, reference):
    for messages in (ROUND[:1], ROUND):
        prompt, text = expected(reference, messages, TOOLS)
        ask = {"model": "tiny", "messages": messages, "tools": TOOLS, "max_tokens": N,
               "temperature": 0, "extra_body": {"ignore_eos": True}}
        whole = oai.chat.completions.create(**ask)
        assert whole.usage.prompt_tokens == prompt and whole.usage.completion_tokens == N
        content, calls = ToolCallReader("hermes", {"get_weather", "noop"}).whole(text)
        assert whole.choices[0].message.content == content
        assert (whole.choices[0].message.tool_calls or []) == calls == []
        chunks = list(oai.chat.completions.create(**ask, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == content
        assert chunks[-1].choices[0].finish_reason == "length"
    none = oai.chat.completions.create(model="tiny", messages=ROUND[:1], tools=TOOLS,
                                       tool_choice="none", max_tokens=1)
    assert none.usage.prompt_tokens == expected(reference, ROUND[:1])[0]    # no tools shown


def test_chat_template_kwargs_reach_the_template(oai, reference):
    plain = oai.chat.completions.create(model="tiny", messages=ROUND[:1], max_tokens=1)
    off = oai.chat.completions.create(model="tiny", messages=ROUND[:1], max_tokens=1,
                                      extra_body={"chat_template_kwargs": {"enable_thinking": False},
                                                  "separate_reasoning": False})
    assert plain.usage.prompt_tokens == expected(reference, ROUND[:1])[0]
    assert off.usage.prompt_tokens == expected(reference, ROUND[:1], None,
                                               {"enable_thinking": False})[0]
    assert off.usage.prompt_tokens > plain.usage.prompt_tokens


def test_responses_whole_and_streamed(oai, reference):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Capital of France?"}]
    prompt, text = expected(reference, messages)
    ask = {"model": "tiny", "input": "Capital of France?", "instructions": "Be brief.",
           "max_output_tokens": N, "temperature": 0, "extra_body": {"ignore_eos": True}}
    whole = oai.responses.create(**ask)
    assert whole.status == "incomplete" and whole.output_text == text
    assert whole.usage.input_tokens == prompt and whole.usage.output_tokens == N
    events = list(oai.responses.create(**ask, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text


# Bounded arguments: the tiny model, free inside a string or a number, writes it on
# until max_tokens; under an enum it must close the call.
SET_UNIT = {"type": "function", "function": {"name": "set_unit", "parameters": {
    "type": "object", "properties": {"unit": {"enum": ["c", "f"]}}, "required": ["unit"]}}}
BOUNDED = [SET_UNIT, TOOLS[1]]        # and noop, which takes no arguments


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "set_unit"}}])
def test_a_forced_call_is_a_call_to_the_tool(oai, choice):
    """tool_choice required / named: the output is constrained by the call's grammar, so
    even the tiny model's text is a call with arguments that fit the tool's schema,
    whole and streamed, greedy and sampled."""
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        ask = {"model": "tiny", "messages": ROUND[:1], "tools": BOUNDED, "tool_choice": choice,
               "max_tokens": 100, "parallel_tool_calls": False} | sampling
        whole = oai.chat.completions.create(**ask)
        (call,) = whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "tool_calls", (call, whole.usage.completion_tokens, sampling)
        if choice != "required":
            assert call.function.name == "set_unit"
        args = json.loads(call.function.arguments)
        assert args in ({"unit": "c"}, {"unit": "f"}) if call.function.name == "set_unit" \
            else args == {}, call
        streamed = list(oai.chat.completions.create(**ask, stream=True))
        deltas = [t for c in streamed if c.choices for t in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == call.function.name
        assert "".join(t.function.arguments or "" for t in deltas) == call.function.arguments
