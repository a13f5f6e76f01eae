"""POST /v1/responses: OpenAI's Responses API, text in and text out
(responses_format.py has the shapes). The conversation goes to the workers as a chat
request does, rendered there with the model's chat template."""
from __future__ import annotations

from contextlib import aclosing

from aiohttp import web

from engines.sampling_params import INT32_MAX
from zpd.http.bodies import decode
from zpd.http.front import FRONT, json_answer, read_body
from zpd.http.openai_format import abort_error
from zpd.http.records import (BadRequest, GenRequest, check_prompts, checked_sampling, integer)
from zpd.http.responses_format import RESPONSES, ResponseAnswer, Responses, input_messages
from zpd.http.sglang_fields import screen
from zpd.http.streams import Stalled, follow, run_all

routes = web.RouteTableDef()
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
            "presence_penalty", "seed", "ignore_eos")


@routes.post("/v1/responses")
async def responses(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    body = await read_body(request)
    unknown = screen(body, RESPONSES)
    front.unknown_fields.note(unknown, "/v1/responses")
    req = decode(body, Responses)
    if req.input is None:
        raise BadRequest("'input' is required")
    item = GenRequest(checked_sampling(_sampling(req)), messages=input_messages(
        req.input, req.instructions), stream=req.stream)
    check_prompts([{"messages": item.messages}], front.config.prompt_limits, "input")
    if front.chat is None:
        raise BadRequest(f"{front.text_problem or 'the model has no chat template'}: "
                         "use /v1/completions or /generate with a prompt or token ids")
    answer = ResponseAnswer(front.model, req)
    if req.stream:
        return await _stream(request, item, answer)
    (out,) = await run_all(front.backend, [item], front.tokenizer, front.config.max_answer_bytes)
    if out.aborted:
        error = abort_error(out)
        raise BadRequest(error["message"], out.status, error["type"])
    status = "incomplete" if (out.finish or {}).get("type") == "length" else "completed"
    return await json_answer(lambda: answer.response(status, out.text, out))


def _sampling(req: Responses) -> dict:
    sampling = {k: v for k in SAMPLING if (v := getattr(req, k)) is not None}
    if req.max_output_tokens is not None:
        sampling["max_new_tokens"] = integer(1, INT32_MAX)("max_output_tokens",
                                                          req.max_output_tokens)
    stop = [req.stop] if isinstance(req.stop, str) else req.stop
    if stop:
        sampling["stop"] = stop
    return sampling


async def _stream(request: web.Request, item: GenRequest,
                  answer: ResponseAnswer) -> web.StreamResponse:
    front = request.app[FRONT]
    events = front.event_stream(request)
    try:
        async with aclosing(follow(front.backend, [item], front.tokenizer)) as outs:
            async for out in outs:
                refused = out.refusal() if events.response is None else None
                if refused is not None:
                    raise refused
                if events.response is None:
                    for event in answer.opening():
                        await events.send(event, event["type"])
                text = out.new_text()
                if text:
                    await events.send(answer.delta(text), "response.output_text.delta")
                if out.finished:
                    for event in answer.closing(out):
                        await events.send(event, event["type"])
        return await events.close(done=False)
    except Stalled:
        return events.abandon([item.rid or ""])
