"""OpenAI's completions and chat completions bodies, checked into GenRequest records.

Sampling fields keep OpenAI's names where they differ from the engine's
(max_tokens, max_completion_tokens); vLLM's and SGLang's extensions that the engine
has (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids) are taken too.
`n` copies of each prompt run as n requests, prompt-major; with a seed, copy i gets
seed + i so the copies differ.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engines.chat import check_messages
from engines.sampler import INT32_MAX
from zpd.http.records import (MAX_TOP_LOGPROBS, BadRequest, GenRequest, boolean, check_count,
                              checked_sampling, integer, logprob_sampling, refuse_set,
                              refuse_unknown, seeded_copies, stop_strings, string, take, token_ids)

MAX_N = 128
COMPLETION_MAX_TOKENS = 16     # OpenAI's default for /v1/completions

SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
            "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
COMMON = SAMPLING + ("model", "max_tokens", "n", "stream", "stream_options", "stop", "user",
                     "skip_special_tokens")
COMPLETION = COMMON + ("prompt", "logprobs", "echo", "best_of", "logit_bias", "suffix")
CHAT = COMMON + ("messages", "max_completion_tokens", "logprobs", "top_logprobs", "metadata",
                 "store", "service_tier", "parallel_tool_calls", "tools", "tool_choice",
                 "functions", "function_call", "response_format", "modalities", "audio",
                 "prediction", "logit_bias", "reasoning_effort")
UNSUPPORTED = ("logit_bias", "suffix", "tools", "functions", "function_call", "audio",
               "prediction", "reasoning_effort")


@dataclass(frozen=True)
class OpenAIRequest:
    """A completions or chat body, checked: `items` holds n requests per prompt,
    prompt-major (prompt p's copy j is item p * n + j, the choice index)."""
    items: list[GenRequest]
    prompts: list[dict]           # each prompt as given: {"text"}, {"input_ids"} or {"messages"}
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None          # top-N per token (0: the sampled token only); None: none
    echo: bool = False


def parse_completion(body: dict) -> OpenAIRequest:
    _common_checks(body, COMPLETION)
    n = take(body, "n", integer(1, MAX_N), 1)
    if take(body, "best_of", integer(1, MAX_N), n) != n:
        raise BadRequest("'best_of' must equal n (every copy generated is returned)")
    if "prompt" not in body or body["prompt"] is None:
        raise BadRequest("'prompt' is required")
    top = take(body, "logprobs", integer(0, MAX_TOP_LOGPROBS))
    prompts = completion_prompts(body["prompt"])
    sampling = _sampling(body, take(body, "max_tokens", integer(1, INT32_MAX),
                                    COMPLETION_MAX_TOKENS))
    return _request(body, prompts, n, sampling | logprob_sampling(top is not None, top or 0), top,
                    take(body, "echo", boolean, False))


def parse_chat(body: dict) -> OpenAIRequest:
    _common_checks(body, CHAT)
    if body.get("tool_choice") not in (None, "none"):
        raise BadRequest("'tool_choice' is not supported by this server (tools are not)")
    if body.get("response_format") not in (None, {"type": "text"}):
        raise BadRequest("'response_format' other than {\"type\": \"text\"} is not supported")
    if body.get("modalities") not in (None, ["text"]):
        raise BadRequest("'modalities' other than [\"text\"] is not supported")
    n = take(body, "n", integer(1, MAX_N), 1)
    want = take(body, "logprobs", boolean, False)
    top = take(body, "top_logprobs", integer(0, MAX_TOP_LOGPROBS))
    if top is not None and not want:
        raise BadRequest("'top_logprobs' needs \"logprobs\": true")
    max_tokens = take(body, "max_completion_tokens", integer(1, INT32_MAX))
    if max_tokens is None:
        max_tokens = take(body, "max_tokens", integer(1, INT32_MAX))
    prompts = [{"messages": chat_messages(body.get("messages"))}]
    sampling = _sampling(body, max_tokens) | logprob_sampling(want, top or 0)
    return _request(body, prompts, n, sampling, (top or 0) if want else None)


def _common_checks(body: dict, known: tuple[str, ...]) -> None:
    refuse_unknown(body, known)
    refuse_set(body, UNSUPPORTED)
    take(body, "model", string)
    take(body, "user", string)
    if take(body, "skip_special_tokens", boolean, True) is not True:
        raise BadRequest("'skip_special_tokens' false is not supported (the text skips them)")


def _sampling(body: dict, max_tokens: int | None) -> dict:
    sampling = {k: body[k] for k in SAMPLING if body.get(k) is not None}
    stop = take(body, "stop", stop_strings)
    if stop:
        sampling["stop"] = stop
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    return sampling


def _request(body: dict, prompts: list[dict], n: int, sampling: dict, top: int | None,
             echo: bool = False) -> OpenAIRequest:
    stream = take(body, "stream", boolean, False)
    options = take(body, "stream_options", _object, {})
    refuse_unknown(options, ("include_usage", "continuous_usage_stats"), "stream_options")
    include_usage = take(options, "include_usage", boolean, False)
    check_count(len(prompts), n)
    copies = seeded_copies(checked_sampling(sampling), n)
    items = [GenRequest(copy, stream=stream, **prompt) for prompt in prompts for copy in copies]
    return OpenAIRequest(items, prompts, n, stream, stream and include_usage, top, echo)


def completion_prompts(value: Any) -> list[dict]:
    """A string, a list of token ids, or a non-empty list of either."""
    if isinstance(value, str):
        return [_text_prompt("prompt", value)]
    if type(value) is not list or not value:
        raise BadRequest("'prompt' must be a string, a list of token ids, or a non-empty list "
                         "of either")
    if all(type(v) is int for v in value):
        return [{"input_ids": token_ids("prompt", value)}]
    if all(isinstance(v, str) for v in value):
        return [_text_prompt(f"prompt[{i}]", v) for i, v in enumerate(value)]
    if all(type(v) is list for v in value):
        return [{"input_ids": token_ids(f"prompt[{i}]", v)} for i, v in enumerate(value)]
    raise BadRequest("'prompt' must not mix strings, token ids and lists")


def _text_prompt(name: str, text: str) -> dict:
    if not text:
        raise BadRequest(f"{name!r} must not be empty")
    return {"text": text}


def chat_messages(value: Any) -> list[dict]:
    """OpenAI messages as the chat template takes them: {"role", "content": str}
    (text parts joined by newlines; "name" kept)."""
    if type(value) is not list or not value:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if type(m) is not dict:
            raise BadRequest(f"messages[{i}] must be an object")
        if "content" not in m:
            raise BadRequest(f"messages[{i}] has no 'content'")
        if m.get("tool_calls") or m.get("function_call"):
            raise BadRequest(f"messages[{i}]: tool calls are not supported by this server")
        msg = {"role": m.get("role"), "content": _content(i, m.get("content"))}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    try:
        check_messages(out)
    except ValueError as e:
        raise BadRequest(str(e)) from None
    return out


def _content(i: int, content: Any) -> Any:
    if content is None:
        return ""
    if type(content) is not list:
        return content                       # check_messages wants a string
    texts = []
    for j, part in enumerate(content):
        if type(part) is not dict or part.get("type") != "text" or type(part.get("text")) is not str:
            raise BadRequest(f"messages[{i}].content[{j}]: only text parts "
                             "({\"type\": \"text\", \"text\": ...}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)


def _object(name: str, value: Any) -> dict:
    if type(value) is not dict:
        raise BadRequest(f"{name!r} must be an object")
    return value
