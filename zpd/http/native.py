"""SGLang's native `POST /generate`: field names as SGLang's, so an RL framework that
speaks to SGLang (slime, AReaL, verl's HTTP adapter) speaks to zpd by changing a URL.

A prompt is `text` or `input_ids`; a list of them is a batch, answered with a list.
`stream: true` answers server-sent events, each carrying the text and output_ids so
far, ending with `data: [DONE]`. A request that ends in an abort or failure still
answers 200 with finish_reason {"type": "abort", "status_code", "message"}; one the
workers refuse as malformed (400, nothing generated) answers HTTP 400.
"""
from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, fields
from typing import Any

from aiohttp import web

from engines.sampler import SamplingParams
from zpd.http.front import FRONT, Front, json_response, read_body
from zpd.http.output import Output
from zpd.http.records import (MAX_TOP_LOGPROBS, BadRequest, GenRequest, boolean, check_count,
                              checked_sampling, integer, logprob_sampling, refuse_set,
                              refuse_unknown, rid_field, take, text_field, token_ids)
from zpd.http.streams import EventStream, follow, run_all

routes = web.RouteTableDef()

ENGINE_SAMPLING = frozenset(f.name for f in fields(SamplingParams))
# SGLang sampling names zpd takes without acting on them: skip_special_tokens (zpd's text
# always skips them) and spaces_between_special_tokens (so none are shown).
IGNORED_SAMPLING = frozenset({"skip_special_tokens", "spaces_between_special_tokens"})
SAMPLING = ENGINE_SAMPLING | IGNORED_SAMPLING | {"no_stop_trim", "n", "sampling_seed"}

PROMPT = ("text", "input_ids")
OPTIONS = ("sampling_params", "rid", "stream", "return_logprob", "top_logprobs_num",
           "return_text_in_logprobs")
# taken and ignored: bookkeeping of SGLang's own that changes no answer
IGNORED = ("log_metrics", "logprob_start_len", "no_logs", "custom_labels", "priority",
           "extra_key", "conversation_id", "data_parallel_rank")
# taken only when absent, null or empty: what zpd cannot do
UNSUPPORTED = ("image_data", "video_data", "audio_data", "input_embeds", "lora_path", "lora_id",
               "custom_logit_processor", "return_hidden_states", "session_params",
               "token_ids_logprob", "bootstrap_host", "bootstrap_port", "bootstrap_room",
               "modalities", "return_entropy", "background")


@dataclass(frozen=True)
class NativeGenerate:
    """A /generate body, checked: one GenRequest per prompt."""
    items: list[GenRequest]
    batch: bool
    stream: bool
    text_in_logprobs: bool


def parse_generate(body: dict) -> NativeGenerate:
    refuse_unknown(body, PROMPT + OPTIONS + IGNORED + UNSUPPORTED)
    refuse_set(body, UNSUPPORTED)
    prompts, batch = _prompts(body)
    check_count(len(prompts))
    samplings = _per_prompt(body, "sampling_params", len(prompts), dict, batch)
    rids = _per_prompt(body, "rid", len(prompts), str, batch)
    stream = take(body, "stream", boolean, False)
    logprobs = logprob_sampling(take(body, "return_logprob", boolean, False),
                                take(body, "top_logprobs_num", integer(0, MAX_TOP_LOGPROBS), 0))
    items = []
    for i, (prompt, raw, rid) in enumerate(zip(prompts, samplings, rids)):
        if rid is not None:
            rid_field(f"rid[{i}]" if batch else "rid", rid)
        sampling, trim = engine_sampling(raw or {})
        items.append(GenRequest(checked_sampling(sampling | logprobs), rid=rid, stream=stream,
                                trim_stop=trim, **prompt))
    return NativeGenerate(items, batch, stream, take(body, "return_text_in_logprobs", boolean, False))


def _prompts(body: dict) -> tuple[list[dict], bool]:
    """[{"text": ...} or {"input_ids": ...}, ...] and whether the body was a batch."""
    given = [k for k in PROMPT if body.get(k) is not None]
    if len(given) != 1:
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    value = body[given[0]]
    if given[0] == "text":
        if isinstance(value, list):
            _non_empty(value, "text")
            return [{"text": text_field(f"text[{i}]", t)} for i, t in enumerate(value)], True
        return [{"text": text_field("text", value)}], False
    if isinstance(value, list) and value and all(isinstance(v, list) for v in value):
        return [{"input_ids": token_ids(f"input_ids[{i}]", ids)} for i, ids in enumerate(value)], True
    return [{"input_ids": token_ids("input_ids", value)}], False


def _per_prompt(body: dict, name: str, n: int, kind: type, batch: bool) -> list[Any]:
    """One value for every prompt: one value for all, or (in a batch) a list of them."""
    value = body.get(name)
    if value is None:
        return [None] * n
    if batch and isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name!r} has {len(value)} entries for {n} prompts")
        for i, v in enumerate(value):
            if v is not None and type(v) is not kind:
                raise BadRequest(f"{name}[{i}] must be {'an object' if kind is dict else 'a string'}")
        return value
    if type(value) is not kind:
        raise BadRequest(f"{name!r} must be {'an object' if kind is dict else 'a string'}"
                         + (" or a list of them, one per prompt" if batch else ""))
    if kind is str and batch:
        raise BadRequest(f"{name!r} of a batch must be a list, one per prompt")
    return [value] * n


def engine_sampling(raw: dict) -> tuple[dict, bool]:
    """SGLang's sampling_params -> (the engine's sampling dict, whether to trim the
    stop string off the text). Nulls count as absent."""
    refuse_unknown(raw, SAMPLING, "sampling_params")
    raw = {k: v for k, v in raw.items() if v is not None}
    if raw.pop("n", 1) != 1:
        raise BadRequest("sampling_params.n must be 1 (send the prompt n times, or use "
                         "/v1/completions with n)")
    if "sampling_seed" in raw:
        raw.setdefault("seed", raw.pop("sampling_seed"))
    trim = not take(raw, "no_stop_trim", boolean, False)
    return {k: v for k, v in raw.items() if k in ENGINE_SAMPLING}, trim


def _non_empty(value: list, name: str) -> None:
    if not value:
        raise BadRequest(f"{name!r} must not be an empty list")


def native_answer(out: Output, text_in_logprobs: bool = False) -> dict:
    """One request's answer (or its progress so far) in SGLang's shape."""
    versions = out.weight_versions
    meta = {"id": out.rid, "finish_reason": out.finish,
            "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
            "weight_version": versions[-1] if versions else None, "weight_versions": versions,
            "retractions": int(out.meta.get("retractions", 0))}
    if out.req.logprobs:
        def named(token_id: int) -> str | None:
            return out.token_text(token_id) if text_in_logprobs else None
        meta["output_token_logprobs"] = [[lp, t, named(t)]
                                         for lp, t in zip(out.logprobs, out.token_ids)]
        if out.req.top_logprobs:
            meta["output_top_logprobs"] = [[[lp, t, named(t)] for t, lp in top]
                                           for top in out.top_logprobs]
    return {"text": out.text, "output_ids": out.token_ids, "meta_info": meta}


def refusal(out: Output) -> BadRequest:
    return BadRequest(str(out.finish.get("message", "bad request")))


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    req = parse_generate(await read_body(request))
    if any(item.text is not None for item in req.items):
        front.needs_text("a text prompt")
    if req.stream:
        return await _stream(request, front, req)
    outs = await run_all(front.backend, req.items, front.tokenizer)
    refused = next((o for o in outs if o.refused), None)
    if refused is not None:
        raise refusal(refused)
    answers = [native_answer(o, req.text_in_logprobs) for o in outs]
    return json_response(answers if req.batch else answers[0])


async def _stream(request: web.Request, front: Front, req: NativeGenerate) -> web.StreamResponse:
    events = EventStream(request)
    async with aclosing(follow(front.backend, req.items, front.tokenizer)) as outs:
        async for out in outs:
            if events.response is None and out.refused:
                raise refusal(out)
            answer = native_answer(out, req.text_in_logprobs)
            await events.send(answer | {"index": out.index} if req.batch else answer)
    return await events.close()
