"""OpenAI's routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions.

A request that does not stream and ends in an abort or failure answers with its
status code in OpenAI's error shape (OpenAI has no partial answers); a streamed one
ends its choice with finish_reason "abort" and an `error` {message, type, code},
then `data: [DONE]`. Chat prompts go to the workers as a conversation, rendered
there with the model's chat template.

A streamed completion with `echo` and `logprobs` sends each choice as one chunk once
it has finished: its first chunk carries the echoed prompt with the prompt's
logprobs (vLLM's shape), and the workers send those with the request's last token."""
from __future__ import annotations

import asyncio

from aiohttp import web

from zpd.http.front import FRONT, Front, json_answer, json_response, read_body
from zpd.http.openai_format import Answer, abort_error
from zpd.http.openai_protocol import OpenAIRequest, parse_chat, parse_completion
from zpd.http.output import Output
from zpd.http.records import BadRequest, check_call_logprobs
from zpd.http.streams import Stalled, pump, run_all

routes = web.RouteTableDef()


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    front = request.app[FRONT]
    return json_response({"object": "list", "data": [
        {"id": front.model, "object": "model", "created": 0, "owned_by": "zpd",
         "root": front.model}]})


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    req = parse_completion(await read_body(request), front.config)
    check_call_logprobs(req.items, front.config.max_call_logprobs)
    front.unknown_fields.note(req.unknown, "/v1/completions")
    if any(p.get("text") is not None for p in req.prompts):
        front.needs_text("a text prompt")
    # a prompt of up to --max-input-ids ids decodes for a while: off the event loop
    echoes = await asyncio.to_thread(lambda: [_prompt_text(front, p) for p in req.prompts]) \
        if req.echo else None
    return await _answer(request, front, req, Answer(front.model, False, req.logprobs, req.echo),
                         echoes)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    req = parse_chat(await read_body(request), front.config, front.tool_parser)
    front.unknown_fields.note(req.unknown, "/v1/chat/completions")
    if front.chat is None:
        raise BadRequest(f"{front.text_problem or 'the model has no chat template'}: "
                         "use /v1/completions or /generate with a prompt or token ids")
    return await _answer(request, front, req, Answer(front.model, True, req.logprobs,
                                                     tools=req.tools))


def _prompt_text(front: Front, prompt: dict) -> str:
    if prompt.get("text") is not None:
        return prompt["text"]
    front.needs_text("echo")
    return front.tokenizer.decode(prompt["input_ids"])


async def _answer(request: web.Request, front: Front, req: OpenAIRequest, answer: Answer,
                  echoes: list[str] | None = None) -> web.StreamResponse:
    if req.stream:
        return await _stream(request, front, req, answer, echoes)
    outs = await run_all(front.backend, req.items, front.tokenizer, front.config.max_answer_bytes)
    failed = next((o for o in outs if o.aborted), None)
    if failed is not None:
        error = abort_error(failed)
        raise BadRequest(error["message"], failed.status, error["type"])
    return await json_answer(lambda: answer.whole(outs, req.n, echoes))


async def _stream(request: web.Request, front: Front, req: OpenAIRequest, answer: Answer,
                  echoes: list[str] | None) -> web.StreamResponse:
    events = front.event_stream(request)
    started: set[int] = set()
    finished: list[Output] = []
    whole = answer.echo and answer.logprobs is not None     # each choice waits for its end

    def render(out: Output) -> bytes | None:
        if not started:             # nothing sent yet: a refused request is an HTTP error
            refused = out.refusal()
            if refused is not None:
                raise refused
        if whole and not out.finished:
            return None
        text, tokens = out.new_text(), out.new_tokens()
        first = out.index not in started
        if not (first or text or tokens or out.finished):
            return None
        started.add(out.index)
        if out.finished:
            finished.append(out)
        echo = echoes[out.index // req.n] if echoes else ""
        return answer.event(out, text, tokens, first, echo, req.include_usage)
    try:
        await pump(front.backend, req.items, front.tokenizer, events, render)
        if req.include_usage:
            await events.send(answer.usage_chunk(finished, req.n))
        return await events.close()
    except Stalled:
        return events.abandon([item.rid or "" for item in req.items])
