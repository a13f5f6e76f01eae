"""The HTTP bodies zpd implements, declared once as models with SGLang's and OpenAI's
field names and defaults: SGLang's `GenerateReqInput` and `SamplingParams`, OpenAI's
(and SGLang's) `CompletionRequest` and `ChatCompletionRequest`.

`decode` checks a body's types in one pass (msgspec, strict: `true` is not an
integer, `1.0` is not a token id) and turns the first wrong one into a 400 naming the
field. JSON null counts as absent: the field keeps its default. Bounds and the rules
between fields are the parsers' (native.py, openai_protocol.py). The fields zpd ignores
or refuses are not declared: sglang_fields.py's tables screen them on the raw body.

Why msgspec: bench/bench_http_bodies.py parses a slime /generate body (512 token ids)
and a chat body; its models decode them about twice as fast as pydantic's."""
from __future__ import annotations

import re
from typing import Any, Optional, TypeVar, Union

import msgspec

from zpd.http.records import BadRequest

Ids = list[Union[int, list[int]]]     # one prompt's ids, or one list per prompt (checked after)
PerPrompt = TypeVar("PerPrompt")


class Body(msgspec.Struct):
    """A body whose null fields take their defaults (null counts as absent)."""

    def __post_init__(self) -> None:
        cls = type(self)
        names = cls.__struct_fields__[len(cls.__struct_fields__) - len(cls.__struct_defaults__):]
        for name, default in zip(names, cls.__struct_defaults__):
            if default is not None and getattr(self, name) is None:
                setattr(self, name, default)


class Sampling(Body):
    """SGLang's sampling_params. The engine's fields default to None (absent: the
    engine's defaults, engines/sampling_params.py); n, skip_special_tokens and
    no_stop_trim are the front's."""
    max_new_tokens: Optional[int] = None
    min_new_tokens: Optional[int] = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: Union[int, list[int], None] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: Optional[bool] = None
    seed: Optional[int] = None
    sampling_seed: Optional[int] = None
    return_logprob: Optional[bool] = None
    top_logprobs_num: Optional[int] = None
    regex: Optional[str] = None
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    n: int = 1
    skip_special_tokens: bool = True
    no_stop_trim: bool = False


class Generate(Body):
    """SGLang's POST /generate. The logprob fields are one value, or one per prompt
    with n = 1 (SGLang's rule; a single prompt is a batch of one)."""
    text: Union[str, list[str], None] = None
    input_ids: Optional[Ids] = None
    sampling_params: Union[Sampling, list[Optional[Sampling]], None] = None
    rid: Union[str, list[str], None] = None
    stream: bool = False
    return_logprob: Union[bool, list[Optional[bool]], None] = None
    top_logprobs_num: Union[int, list[Optional[int]], None] = None
    logprob_start_len: Union[int, list[Optional[int]], None] = None
    token_ids_logprob: Optional[list[Union[int, list[int], None]]] = None
    return_text_in_logprobs: Union[bool, list[Optional[bool]], None] = None
    return_routed_experts: Union[bool, list[Optional[bool]], None] = None
    return_routed_expert_weights: Union[bool, list[Optional[bool]], None] = None    # zpd's


class OpenAIBody(Body):
    """What /v1/completions and /v1/chat/completions share: OpenAI's fields, and the
    vLLM and SGLang extensions the engine has."""
    n: int = 1
    stream: bool = False
    stream_options: Optional[dict] = None
    max_tokens: Optional[int] = None
    min_tokens: int = 0
    stop: Union[str, list[str], None] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = None
    ignore_eos: Optional[bool] = None
    stop_token_ids: Union[int, list[int], None] = None
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    rid: Union[str, list[str], None] = None
    regex: Optional[str] = None                  # SGLang's; one at most of these four
    json_schema: Optional[str] = None
    ebnf: Optional[str] = None
    response_format: Optional[dict] = None       # zpd/http/structured.py


class Completion(OpenAIBody):
    """POST /v1/completions: `prompt` is a string, token ids, or a list of either."""
    prompt: Union[str, list[Union[str, int, list[int]]], None] = None
    best_of: Optional[int] = None
    echo: bool = False
    logprobs: Optional[int] = None


class Chat(OpenAIBody):
    """POST /v1/chat/completions; `messages` is checked by openai_protocol.chat_messages."""
    messages: Optional[list[Any]] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    tools: Optional[list[Any]] = None                 # checked by tool_calls.py
    tool_choice: Union[str, dict, None] = None
    parallel_tool_calls: Optional[bool] = None
    chat_template_kwargs: Optional[dict] = None       # the template's extra variables


Model = TypeVar("Model", bound=Body)
_WHERE = re.compile(r" - at `\$\.?(.*)`$")


def decode(body: dict, model: type[Model], where: str = "") -> Model:
    """`body` as `model`; a 400 naming the first field of a wrong type."""
    try:
        return msgspec.convert(body, model, strict=True)
    except msgspec.ValidationError as e:
        raise BadRequest(_named(str(e), where)) from None


def _named(error: str, where: str) -> str:
    """msgspec's "Expected `int | null`, got `str` - at `$.sampling_params.n`" in the
    words of records.py's checks: "'n' (sampling_params.n) must be an integer, not a
    string"."""
    found = _WHERE.search(error)
    what = error[:found.start()] if found else error
    path = f"{where}{found.group(1)}" if found else where.rstrip(".")
    expected, _, got = what.removeprefix("Expected ").replace("`", "").partition(", got ")
    kinds = [_WORDS.get(k, k) for k in expected.split(" | ") if k != "null"]
    leaf = path.rsplit(".", 1)[-1]
    name = f"'{leaf}'" + (f" ({path})" if path != leaf else "")
    return f"{name} must be {' or '.join(kinds)}" + (f", not {_KINDS.get(got, got)}" if got else "")


_WORDS = {"int": "an integer", "bool": "true or false", "str": "a string", "float": "a number",
          "array": "a list", "object": "an object"}
_KINDS = _WORDS | {"bool": "a boolean", "null": "null"}
