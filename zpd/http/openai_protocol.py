"""OpenAI's completions and chat completions bodies, checked into GenRequest records.

Sampling fields keep OpenAI's names where they differ from the engine's
(max_tokens, max_completion_tokens, min_tokens); vLLM's and SGLang's extensions that
the engine has (top_k, min_p, repetition_penalty, ignore_eos, stop_token_ids) are
taken too, and SGLang's output options (no_stop_trim, skip_special_tokens, rid).
Which fields are taken, ignored or refused: sglang_fields.py. `n` copies of each
prompt run as n requests, prompt-major; with a seed, copy i gets seed + i so the
copies differ. Completions' `echo` with `logprobs` asks the workers for the prompt's
logprobs too (logprob_start_len 0), and `max_tokens: 0` with `echo` is a scoring
request (max_new_tokens 0: a prefill alone), as vLLM serves them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engines.formats.chat import check_messages, check_variables
from engines.sampling_params import INT32_MAX
from zpd.config import HttpConfig
from zpd.http.bodies import Chat, Completion, OpenAIBody, decode
from zpd.http.records import (MAX_TOP_LOGPROBS, BadRequest, GenRequest, boolean, check_count,
                              check_prompts, checked_sampling, integer, item_rids,
                              logprob_sampling, seeded_copies, take, token_ids)
from zpd.http.sglang_fields import CHAT, COMPLETION, screen
from zpd.http.structured import grammar_sampling, response_format
from zpd.http.tool_calls import ToolUse, forced_sampling, tool_request

MAX_N = 128
DEFAULTS = HttpConfig()
COMPLETION_MAX_TOKENS = 16     # OpenAI's default for /v1/completions

SAMPLING = ("temperature", "top_p", "presence_penalty", "frequency_penalty", "seed",
            "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids")
STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


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
    echo: bool = False            # completions: the prompt's text (and logprobs) lead each choice
    unknown: tuple[str, ...] = () # names neither SGLang nor OpenAI has (warned, dropped)
    tools: ToolUse | None = None  # chat: how its answer is read for tool calls


def parse_completion(body: dict, cfg: HttpConfig = DEFAULTS) -> OpenAIRequest:
    unknown = screen(body, COMPLETION)
    req = decode(body, Completion)
    n = integer(1, MAX_N)("n", req.n)
    if req.best_of is not None and integer(1, MAX_N)("best_of", req.best_of) != n:
        raise BadRequest("'best_of' must equal n (every copy generated is returned)")
    if req.prompt is None:
        raise BadRequest("'prompt' is required")
    top = None if req.logprobs is None else integer(0, MAX_TOP_LOGPROBS)("logprobs", req.logprobs)
    prompts = completion_prompts(req.prompt)
    check_prompts(prompts, cfg.prompt_limits, "prompt")
    max_tokens = COMPLETION_MAX_TOKENS if req.max_tokens is None else \
        integer(0, INT32_MAX)("max_tokens", req.max_tokens)
    if max_tokens == 0 and not req.echo:
        raise BadRequest("'max_tokens' must be at least 1 unless \"echo\": true "
                         "('max_tokens': 0 with echo scores the prompt, as vLLM's)")
    # echo with logprobs covers the prompt's tokens too: the prefill's, from position 0
    asks = logprob_sampling(top is not None, top or 0, 0 if req.echo else -1)
    return _request(req, prompts, n, _sampling(req, max_tokens) | asks, top, unknown, cfg,
                    req.echo)


def parse_chat(body: dict, cfg: HttpConfig = DEFAULTS,
               tool_parser: str | None = None) -> OpenAIRequest:
    """A chat body; `tool_parser`: how tool calls are written (None: tools are refused)."""
    unknown = screen(body, CHAT)
    req = decode(body, Chat)
    n = integer(1, MAX_N)("n", req.n)
    top = None if req.top_logprobs is None else \
        integer(0, MAX_TOP_LOGPROBS)("top_logprobs", req.top_logprobs)
    if top is not None and not req.logprobs:
        raise BadRequest("'top_logprobs' needs \"logprobs\": true")
    max_tokens = next(((name, v) for name, v in (("max_completion_tokens", req.max_completion_tokens),
                                                 ("max_tokens", req.max_tokens)) if v is not None),
                      None)
    if max_tokens is not None:
        max_tokens = integer(1, INT32_MAX)(*max_tokens)
    tools, rendered, forced = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls,
                                           tool_parser)
    extra = ({"tools": rendered} if rendered else {}) | _template_kwargs(req.chat_template_kwargs)
    prompts = [{"messages": chat_messages(req.messages)} | ({"chat_extra": extra} if extra else {})]
    check_prompts(prompts, cfg.prompt_limits, "messages")
    sampling = forced_sampling(_sampling(req, max_tokens), forced) | \
        logprob_sampling(req.logprobs, top or 0)
    return _request(req, prompts, n, sampling, (top or 0) if req.logprobs else None, unknown, cfg,
                    tools=tools)


def _template_kwargs(kwargs: dict | None) -> dict:
    """chat_template_kwargs for the workers' template: any names but those the server
    sets itself."""
    if not kwargs:
        return {}
    try:
        return {"chat_template_kwargs": check_variables(kwargs)}
    except ValueError as e:
        raise BadRequest(f"'chat_template_kwargs': {e}") from None


def _sampling(req: OpenAIBody, max_tokens: int | None) -> dict:
    sampling = {k: v for k in SAMPLING if (v := getattr(req, k)) is not None}
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop:
        sampling["stop"] = stop
    if max_tokens is not None:
        sampling["max_new_tokens"] = max_tokens
    if integer(0, INT32_MAX)("min_tokens", req.min_tokens):
        sampling["min_new_tokens"] = req.min_tokens
    return sampling | grammar_sampling({"regex": req.regex, "json_schema": req.json_schema,
                                        "ebnf": req.ebnf,
                                        "response_format": response_format(req.response_format)})


def _request(req: OpenAIBody, prompts: list[dict], n: int, sampling: dict, top: int | None,
             unknown: list[str], cfg: HttpConfig, echo: bool = False,
             tools: ToolUse | None = None) -> OpenAIRequest:
    options = req.stream_options or {}
    unknown += [f"stream_options.{k}" for k in options if k not in STREAM_OPTIONS]
    include_usage = take(options, "include_usage", boolean, False)
    check_count(len(prompts), n, cfg.max_batch_requests)
    copies = seeded_copies(checked_sampling(sampling), n)
    rids = _prompt_major(item_rids(req.rid, len(prompts), n, len(prompts) > 1),
                         len(prompts), n)
    output = {"trim_stop": not req.no_stop_trim, "skip_special": req.skip_special_tokens}
    items = [GenRequest(copy, stream=req.stream, rid=rids[p * n + j], **output, **prompt)
             for p, prompt in enumerate(prompts) for j, copy in enumerate(copies)]
    return OpenAIRequest(items, prompts, n, req.stream, req.stream and include_usage, top, echo,
                         tuple(unknown), tools)


def _prompt_major(rids: list, prompts: int, n: int) -> list:
    """item_rids' copy-major order (j * prompts + p) as OpenAI's choices' (p * n + j)."""
    return [rids[j * prompts + p] for p in range(prompts) for j in range(n)]


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
    (text parts joined by newlines; "name" and a tool result's "tool_call_id" kept; an
    assistant turn's "tool_calls" with their arguments as objects, as HF's templates
    read them and SGLang hands them over)."""
    if type(value) is not list or not value:
        raise BadRequest("'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(value):
        if type(m) is not dict:
            raise BadRequest(f"messages[{i}] must be an object")
        if "content" not in m and not m.get("tool_calls"):
            raise BadRequest(f"messages[{i}] has no 'content'")
        if m.get("function_call"):
            raise BadRequest(f"messages[{i}]: 'function_call' is the older form; send "
                             "'tool_calls'")
        msg = {"role": m.get("role"), "content": _content(i, m.get("content"))}
        for key in ("name", "tool_call_id"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        if m.get("tool_calls"):
            msg["tool_calls"] = _tool_calls(i, m["tool_calls"])
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


def _tool_calls(i: int, calls: Any) -> list[dict]:
    """An assistant turn's calls for the template: each {"id", "type", "function":
    {"name", "arguments"}}, the arguments' JSON text read into an object (kept as text
    where it is not JSON)."""
    if type(calls) is not list:
        raise BadRequest(f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if type(call) is dict else None
        if type(fn) is not dict or type(fn.get("name")) is not str:
            raise BadRequest(f"messages[{i}].tool_calls[{j}] must be {{\"type\": \"function\", "
                             "\"function\": {\"name\", \"arguments\"}}")
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                pass
        out.append({k: v for k, v in call.items() if k != "function"} |
                   {"type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
