"""SGLang's (and vLLM's) /tokenize and /detokenize, also under /v1/: the model's
tokenizer in the front, the one that turns /generate's text into the ids the workers
see (the workers encode a text prompt the same way: special tokens added).

/tokenize {"prompt": str | [str], "add_special_tokens": true} -> {"tokens", "count",
"max_model_len"} (lists for a list of prompts); max_model_len is the cluster's context
length (-1 when the router does not answer, as SGLang's answer where its tokenizer
names none). /detokenize {"tokens": [id] | [[id]], "skip_special_tokens": true} ->
{"text"} (a list for a list); an id the tokenizer does not know decodes to nothing, as
in SGLang (a model's vocabulary may be padded past its tokenizer's). Prompts and id
lists are bounded as /generate's are (--max-text-bytes, --max-input-ids); tokenizing
runs off the event loop."""
from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import web

from zpd.http.front import FRONT, Front, json_response, read_body
from zpd.http.info_routes import STATUS_TIMEOUT_S, cluster_status, live
from zpd.http.records import BadRequest, boolean, check_prompts, take, text_field, token_ids

routes = web.RouteTableDef()

TOKENIZE = ("model", "prompt", "add_special_tokens")     # SGLang's TokenizeRequest
DETOKENIZE = ("model", "tokens", "skip_special_tokens")  # and DetokenizeRequest


def _unknown(front: Front, body: dict, known: tuple[str, ...], where: str) -> None:
    front.unknown_fields.note([k for k in body if k not in known], where)


def _prompts(value: Any) -> tuple[list[str], bool]:
    """The texts to tokenize, and whether they came as a list."""
    if isinstance(value, list):
        if not value:
            raise BadRequest("'prompt' must not be an empty list")
        return [text_field(f"prompt[{i}]", t) for i, t in enumerate(value)], True
    if value is None:
        raise BadRequest("'prompt' is required: a string or a list of strings")
    return [text_field("prompt", value)], False


async def _context_length(front: Front) -> int:
    try:
        reply = await cluster_status(front, STATUS_TIMEOUT_S)
    except BadRequest:
        return -1
    lengths = [w.get("context_length") for w in live(reply)]
    return next((n for n in lengths if type(n) is int), -1)


@routes.post("/tokenize")
@routes.post("/v1/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    body = await read_body(request)
    _unknown(front, body, TOKENIZE, "/tokenize")
    texts, listed = _prompts(body.get("prompt"))
    special = take(body, "add_special_tokens", boolean, True)
    check_prompts([{"text": t} for t in texts], front.config.prompt_limits, "prompt")
    front.needs_text("/tokenize")
    tokens = await asyncio.to_thread(lambda: [front.tokenizer.encode(t, special) for t in texts])
    counts = [len(ids) for ids in tokens]
    return json_response({"tokens": tokens if listed else tokens[0],
                          "count": counts if listed else counts[0],
                          "max_model_len": await _context_length(front)})


def _id_lists(value: Any) -> tuple[list[list[int]], bool]:
    """The id lists to decode, and whether they came as a list of lists."""
    if type(value) is not list:
        raise BadRequest("'tokens' must be a list of token ids or a list of such lists")
    if value and all(type(v) is list for v in value):
        return [_ids(f"tokens[{i}]", ids) for i, ids in enumerate(value)], True
    return [_ids("tokens", value)], False


def _ids(name: str, value: list) -> list[int]:
    return token_ids(name, value) if value else []


@routes.post("/detokenize")
@routes.post("/v1/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    body = await read_body(request)
    _unknown(front, body, DETOKENIZE, "/detokenize")
    lists, listed = _id_lists(body.get("tokens"))
    skip = take(body, "skip_special_tokens", boolean, True)
    limits = front.config.prompt_limits
    check_prompts([{"input_ids": ids} for ids in lists], limits, "tokens")
    front.needs_text("/detokenize")
    texts = await asyncio.to_thread(lambda: [front.tokenizer.decode(ids, skip) for ids in lists])
    return json_response({"text": texts if listed else texts[0]})
