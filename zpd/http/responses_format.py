"""OpenAI's Responses API in its text form: a body's `input` and `instructions` as a
conversation, and the answer as a `response` object, whole or as the stream of
`response.*` events that the openai client's `responses.create(stream=True)` and
`responses.stream()` read:

    response.created, response.in_progress, response.output_item.added,
    response.content_part.added, response.output_text.delta (one per new text),
    response.output_text.done, response.content_part.done, response.output_item.done,
    response.completed (or response.incomplete past max_output_tokens, or
    response.failed when the request ends in an error)

Only text goes in and out: other input items (images, files, function calls and
their outputs, references to stored responses) are refused by name.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

from zpd.http.bodies import Body
from zpd.http.output import Output
from zpd.http.records import BadRequest
from zpd.http.sglang_fields import IGN, IMPL, refused

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


class Responses(Body):
    """POST /v1/responses; `input` is checked by input_messages."""
    input: Union[str, list[Any], None] = None
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    # extensions SGLang's ResponsesRequest takes too
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    seed: Optional[int] = None
    stop: Union[str, list[str], None] = None
    ignore_eos: Optional[bool] = None


RESPONSES = {name: IMPL for name in Responses.__struct_fields__} | {
    "model": IGN, "user": IGN, "metadata": IGN, "store": IGN, "service_tier": IGN,
    "parallel_tool_calls": IGN, "prompt_cache_key": IGN, "safety_identifier": IGN,
    "max_tool_calls": IGN, "stream_options": IGN, "request_id": IGN, "priority": IGN,
    "tools": refused("/v1/responses serves text; tools are served on /v1/chat/completions"),
    "tool_choice": refused("/v1/responses serves text", "auto", "none"),
    "previous_response_id": refused("zpd stores no responses"),
    "conversation": refused("zpd stores no conversations"),
    "background": refused("zpd answers in the foreground"),
    "prompt": refused("zpd has no stored prompt templates"),
    "reasoning": refused("zpd has no reasoning controls"),
    "include": refused("zpd adds nothing to a response's output"),
    "top_logprobs": refused("/v1/responses returns no logprobs; /v1/chat/completions does"),
    "text": refused("zpd answers plain text here", {"format": {"type": "text"}}),
    "truncation": refused("zpd never truncates a conversation", "disabled"),
}


def input_messages(value: Any, instructions: str | None) -> list[dict]:
    """The conversation of `input` (a string, or a list of messages) after the
    `instructions` as a system turn."""
    head = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(value, str):
        return head + [{"role": "user", "content": value}]
    if type(value) is not list or not value:
        raise BadRequest("'input' must be a string or a non-empty list of messages")
    out = []
    for i, item in enumerate(value):
        if type(item) is not dict or item.get("type", "message") != "message":
            kind = item.get("type") if type(item) is dict else type(item).__name__
            raise BadRequest(f"input[{i}]: only messages are supported, not {kind!r}")
        role = ROLES.get(item.get("role"))
        if role is None:
            raise BadRequest(f"input[{i}].role must be one of {', '.join(ROLES)}")
        out.append({"role": role, "content": _text(i, item.get("content"))})
    return head + out


def _text(i: int, content: Any) -> str:
    if isinstance(content, str):
        return content
    if type(content) is not list:
        raise BadRequest(f"input[{i}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if type(part) is not dict or part.get("type") not in TEXT_PARTS \
                or type(part.get("text")) is not str:
            raise BadRequest(f"input[{i}].content[{j}]: only text parts "
                             "({\"type\": \"input_text\", \"text\": ...}) are supported")
        texts.append(part["text"])
    return "\n".join(texts)


class ResponseAnswer:
    """One response's identity, what the body asked, and its events (numbered)."""

    def __init__(self, model: str, req: Responses) -> None:
        self.id = "resp_" + uuid.uuid4().hex
        self.item_id = "msg_" + uuid.uuid4().hex
        self.created = int(time.time())
        self.model, self.req = model, req
        self.sequence = 0

    def response(self, status: str, text: str | None = None, out: Output | None = None,
                 error: dict | None = None) -> dict:
        """The response object: `status` in_progress (no output yet), completed,
        incomplete (with why) or failed (with `error`)."""
        req = self.req
        body = {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "model": self.model, "output": [], "error": error,
                "incomplete_details": None, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "temperature": req.temperature,
                "top_p": req.top_p, "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": [], "text": {"format": {"type": "text"}}, "metadata": {},
                "previous_response_id": None, "reasoning": None, "store": False,
                "truncation": "disabled", "usage": None}
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if text is not None:
            body["output"] = [self.message(text, "incomplete" if status == "incomplete"
                                           else "completed")]
        if out is not None:
            body["usage"] = usage(out)
        return body

    def message(self, text: str | None, status: str) -> dict:
        content = [] if text is None else [self.part(text)]
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": []}

    def event(self, kind: str, **fields: Any) -> dict:
        self.sequence += 1
        return {"type": f"response.{kind}", "sequence_number": self.sequence - 1} | fields

    def opening(self) -> list[dict]:
        """The events before the first text."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [self.event("created", response=self.response("in_progress")),
                self.event("in_progress", response=self.response("in_progress")),
                self.event("output_item.added", output_index=0,
                           item=self.message(None, "in_progress")),
                self.event("content_part.added", **where, part=self.part(""))]

    def delta(self, text: str) -> dict:
        return self.event("output_text.delta", item_id=self.item_id, output_index=0,
                          content_index=0, delta=text, logprobs=[])

    def closing(self, out: Output) -> list[dict]:
        """The events after the last text: the whole text, then the response."""
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        status = status_of(out)
        if status == "failed":
            return [self.event("failed", response=self.response(
                "failed", None, out, {"code": str(out.status), "message": _message(out)}))]
        item = self.message(out.text, "incomplete" if status == "incomplete" else "completed")
        return [self.event("output_text.done", **where, text=out.text, logprobs=[]),
                self.event("content_part.done", **where, part=self.part(out.text)),
                self.event("output_item.done", output_index=0, item=item),
                self.event(status, response=self.response(status, out.text, out))]


def status_of(out: Output) -> str:
    if out.aborted:
        return "failed"
    return "incomplete" if (out.finish or {}).get("type") == "length" else "completed"


def _message(out: Output) -> str:
    return str((out.finish or {}).get("message", "aborted"))


def usage(out: Output) -> dict:
    return {"input_tokens": out.prompt_tokens, "output_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "input_tokens_details": {"cached_tokens": int(out.meta.get("cached_tokens", 0))},
            "output_tokens_details": {"reasoning_tokens": 0}}
