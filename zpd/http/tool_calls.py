"""OpenAI's `tools` and `tool_choice` on a chat request, checked: which tools the
template gets, how the answer is read (tool_parsers.py), and, for a forced call, the
grammar that holds the output to it (tool_grammar.py).

- tool_choice "none": the template gets no tools and the text is not read for calls
  (SGLang's behaviour);
- "auto" (the default with tools): the template gets them; calls the model writes
  are read into `tool_calls`;
- "required", or a named function {"type": "function", "function": {"name": ...}}:
  as "auto", and the output is constrained to calls (to that function) by the EBNF
  set as the request's `ebnf` sampling parameter, which needs the server's
  structured-output support.

Tools need a tool-call parser: --tool-call-parser, else the one the chat template
shows (Front.tool_parser); without one a request with tools is refused by name.
"""
from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any

from engines.sampling_params import SamplingParams
from zpd.http.records import BadRequest
from zpd.http.tool_grammar import forced_call_grammar
from zpd.http.tool_parsers import PYTHON_TAG, ToolCallReader

NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")     # OpenAI's function names
MAX_TOOLS = 128
GRAMMAR_FIELDS = ("ebnf", "json_schema", "regex")


@dataclass(frozen=True)
class ToolUse:
    """A request's tools as the answer reads them."""
    parser: str
    names: frozenset[str]
    forced: bool                   # "required" or a named function

    def reader(self) -> ToolCallReader:
        return ToolCallReader(self.parser, set(self.names))


def default_parser(template_source: str | None) -> str | None:
    """The parser a chat template shows it writes for (None where it shows none)."""
    if not template_source:
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if PYTHON_TAG in template_source:
        return "llama3"
    return None


def tool_request(tools: Any, choice: Any, parallel: Any,
                 parser: str | None) -> tuple[ToolUse | None, list[dict] | None, dict]:
    """(how the answer is read, the tools the template gets, sampling fields to add)
    for a chat body's `tools`, `tool_choice` and `parallel_tool_calls`."""
    checked = check_tools(tools)
    if choice is None:
        choice = "auto" if checked else "none"
    named = _named(choice)
    if named is None and choice not in ("none", "auto", "required"):
        raise BadRequest("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if choice == "none":
        return None, None, {}
    if not checked:
        raise BadRequest(f"'tool_choice' {json.dumps(choice)[:100]} needs 'tools'")
    if parser is None:
        raise BadRequest("'tools' need a tool-call parser: this server was started without "
                         "--tool-call-parser, and its chat template shows none (hermes, "
                         "qwen25 or llama3)")
    names = [t["function"]["name"] for t in checked]
    if named is not None and named not in names:
        raise BadRequest(f"'tool_choice' names the function {named!r}, which is not in 'tools'")
    use = ToolUse(parser, frozenset(names), choice != "auto")
    if not use.forced:
        return use, checked, {}
    forced = [t for t in checked if named is None or t["function"]["name"] == named]
    if parallel is not None and not isinstance(parallel, bool):
        raise BadRequest("'parallel_tool_calls' must be true or false")
    grammar = forced_call_grammar(parser, forced, parallel is not False and named is None)
    return use, checked, {"ebnf": grammar}


def forced_sampling(sampling: dict, extra: dict) -> dict:
    """`sampling` with a forced call's grammar; 400 where the request has a grammar of
    its own, or the server has no constrained decoding."""
    if not extra:
        return sampling
    given = [k for k in GRAMMAR_FIELDS if sampling.get(k) is not None]
    if given:
        raise BadRequest(f"'tool_choice' forces a tool call, which constrains the output: "
                         f"it cannot be combined with {given[0]!r}")
    if "ebnf" not in {f.name for f in dataclasses.fields(SamplingParams)}:
        raise BadRequest("'tool_choice' \"required\" or a named function needs constrained "
                         "decoding, which this server lacks; use \"auto\"")
    return sampling | extra


def check_tools(tools: Any) -> list[dict]:
    """OpenAI function tools, each {"type": "function", "function": {"name", ...}}."""
    if tools is None:
        return []
    if type(tools) is not list or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools")
    seen = set()
    for i, tool in enumerate(tools):
        if type(tool) is not dict or tool.get("type") != "function":
            raise BadRequest(f"tools[{i}]: only {{\"type\": \"function\", \"function\": "
                             "{...}} tools are supported")
        fn = tool.get("function")
        if type(fn) is not dict or type(fn.get("name")) is not str \
                or not NAME.fullmatch(fn["name"]):
            raise BadRequest(f"tools[{i}].function.name must be 1 to 64 letters, digits, "
                             "'_', '.' or '-'")
        if fn.get("parameters") is not None and type(fn["parameters"]) is not dict:
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object")
        if fn.get("description") is not None and type(fn["description"]) is not str:
            raise BadRequest(f"tools[{i}].function.description must be a string")
        if fn["name"] in seen:
            raise BadRequest(f"tools[{i}]: a second function named {fn['name']!r}")
        seen.add(fn["name"])
    return tools


def _named(choice: Any) -> str | None:
    if type(choice) is not dict:
        return None
    fn = choice.get("function")
    if choice.get("type") != "function" or type(fn) is not dict or type(fn.get("name")) is not str:
        raise BadRequest("'tool_choice' as an object must be {\"type\": \"function\", "
                         "\"function\": {\"name\": ...}}")
    return fn["name"]
