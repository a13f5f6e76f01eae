"""Answers in OpenAI's shapes: completions and chat completions, whole or as stream
chunks, with usage and logprobs, from the Outputs of a route's requests.

A completion with `echo` and `logprobs` covers the prompt's tokens first, as vLLM's:
their logprobs are the prefill's (the workers' input_token_logprobs, position 0's
null), followed by the completion's."""
from __future__ import annotations

import itertools
import time
import uuid

import orjson

from zpd.http.output import Output
from zpd.http.tool_calls import ToolUse
from zpd.http.tool_parsers import ToolCallReader


class Answer:
    """One OpenAI answer's identity and the formatting of its parts."""

    def __init__(self, model: str, chat: bool, logprobs: int | None, echo: bool = False,
                 tools: ToolUse | None = None) -> None:
        self.model, self.chat, self.logprobs, self.echo = model, chat, logprobs, echo
        self.tools = tools                      # chat: the answer is read for tool calls
        self.readers: dict[int, ToolCallReader] = {}    # a stream's, per choice
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self._event_head: bytes | None = None       # a stream chunk's bytes up to its index

    def _head(self, chunk: bool) -> dict:
        kind = "chat.completion.chunk" if chunk and self.chat else self.object
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    # --- whole answers --------------------------------------------------------------

    def whole(self, outs: list[Output], n: int, echoes: list[str] | None = None) -> dict:
        """The answer to a request that did not stream; `echoes`: each prompt's text
        (completions with echo)."""
        choices = []
        for out in outs:
            echo = echoes[out.index // n] if echoes else ""
            every = range(len(out.token_ids))
            calls: list[dict] = []
            if self.chat:
                message = {"role": "assistant", "content": out.text}
                if self.tools is not None:
                    message["content"], calls = self.tools.reader().whole(out.text)
                    message |= {"tool_calls": calls} if calls else {}
                choice = {"index": out.index, "message": message,
                          "logprobs": self.chat_logprobs(out, every)}
            else:
                choice = {"index": out.index, "text": echo + out.text,
                          "logprobs": self.completion_logprobs(out, every, len(echo), self.echo)}
            choices.append(choice | {"finish_reason": finish_reason(out, bool(calls))})
        return self._head(False) | {"choices": choices, "usage": usage(outs, n)}

    # --- stream chunks ----------------------------------------------------------------

    def chunk(self, out: Output, text: str, tokens: range, first: bool, echo: str = "",
              include_usage: bool = False) -> dict:
        """A stream chunk for one choice: the text and tokens new since its last chunk
        (`first`: its first chunk); its finish_reason once it has finished, with an
        `error` {message, type, code} when it ended in an abort or failure."""
        calls = False
        if self.chat:
            deltas: list[dict] = []
            if self.tools is not None:
                text, deltas = self._read_calls(out, text)
                calls = bool(self.readers[out.index].calls)
            delta = ({"role": "assistant"} if first else {}) | \
                ({"content": text} if text or first else {}) | \
                ({"tool_calls": deltas} if deltas else {})
            choice = {"index": out.index, "delta": delta, "logprobs": self.chat_logprobs(out, tokens)}
        else:
            choice = {"index": out.index, "text": (echo if first else "") + text,
                      "logprobs": self.completion_logprobs(out, tokens, len(echo),
                                                           self.echo and first)}
        choice["finish_reason"] = finish_reason(out, calls)
        if out.aborted:
            choice["error"] = abort_error(out)
        return self._head(True) | {"choices": [choice]} | ({"usage": None} if include_usage else {})

    def event(self, out: Output, text: str, tokens: range, first: bool, echo: str = "",
              include_usage: bool = False) -> bytes:
        """`chunk` as an SSE event. The common one (not a choice's first or last, no
        logprobs, no tools) is written from its head serialized once per answer."""
        if first or out.finished or self.tools is not None or \
                (self.logprobs is not None and out.req.logprobs):
            return b"data: " + orjson.dumps(self.chunk(out, text, tokens, first, echo,
                                                       include_usage)) + b"\n\n"
        if self._event_head is None:
            self._event_head = b"data: " + orjson.dumps(self._head(True))[:-1] + \
                b',"choices":[{"index":'
        if self.chat:
            body = b'"delta":{"content":%b}' % orjson.dumps(text) if text else b'"delta":{}'
        else:
            body = b'"text":%b' % orjson.dumps(text)
        return b'%b%d,%b,"logprobs":null,"finish_reason":null}]%b}\n\n' % (
            self._event_head, out.index, body, b',"usage":null' if include_usage else b"")

    def _read_calls(self, out: Output, text: str) -> tuple[str, list[dict]]:
        """A streamed choice's new text as content and tool-call deltas."""
        reader = self.readers.setdefault(out.index, self.tools.reader())
        text, deltas = reader.feed(text)
        if out.finished:
            rest, more = reader.finish()
            text, deltas = text + rest, deltas + more
        return text, deltas

    def usage_chunk(self, outs: list[Output], n: int) -> dict:
        return self._head(True) | {"choices": [], "usage": usage(outs, n)}

    # --- logprobs -------------------------------------------------------------------

    def completion_logprobs(self, out: Output, tokens: range, echo_chars: int,
                            prompt: bool = False) -> dict | None:
        """The legacy shape: parallel lists over `tokens`, after the prompt's tokens
        where `prompt` (echo); text_offset counts from the start of the choice's text."""
        if self.logprobs is None or not out.req.logprobs:
            return None
        texts = [out.token_text(out.token_ids[i]) for i in tokens]
        tops = [self._top(out, out.top_logprobs[i]) if i < len(out.top_logprobs) else None
                for i in tokens]
        head = self.prompt_logprobs(out) if prompt else dict.fromkeys(LEGACY_KEYS, [])
        return {"tokens": head["tokens"] + texts,
                "token_logprobs": head["token_logprobs"] + [_at(out.logprobs, i) for i in tokens],
                "top_logprobs": head["top_logprobs"] + tops,
                "text_offset": head["text_offset"] +
                [echo_chars + off for off in out.text_offsets(tokens)]}

    def prompt_logprobs(self, out: Output) -> dict:
        """The echoed prompt's tokens in the legacy shape, from what the workers sent with
        the finished request: position 0 has no logprob (null, its top_logprobs too);
        each token's text_offset counts the texts of the tokens before it, as vLLM's
        (a special token the echoed text leaves out still counts). Empty lists where
        the workers sent none (a request that failed before its prefill answered)."""
        pairs = out.meta.get("input_token_logprobs") or []
        tops = out.meta.get("input_top_logprobs") or [None] * len(pairs)
        texts = [out.token_text(t) for _, t in pairs]
        return {"tokens": texts, "token_logprobs": [lp for lp, _ in pairs],
                "top_logprobs": [self._top(out, top) for top in tops],
                "text_offset": list(itertools.accumulate(map(len, texts), initial=0))[:-1]}

    def _top(self, out: Output, top: list | None) -> dict | None:
        """One position's alternatives as {token text: logprob} (None when logprobs is 0
        or the position has none)."""
        if not self.logprobs or top is None:
            return None
        return {out.token_text(int(t)): lp for t, lp in top}

    def chat_logprobs(self, out: Output, tokens: range) -> dict | None:
        if self.logprobs is None or not out.req.logprobs:
            return None
        return {"content": [_entry(out, out.token_ids[i], _at(out.logprobs, i)) | {
            "top_logprobs": [_entry(out, t, lp) for t, lp in
                             (out.top_logprobs[i] if i < len(out.top_logprobs) else [])]}
            for i in tokens]}


LEGACY_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _entry(out: Output, token_id: int, logprob: float | None) -> dict:
    text = out.token_text(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def _at(values: list[float], i: int) -> float | None:
    return values[i] if i < len(values) else None


def finish_reason(out: Output, calls: bool = False) -> str | None:
    """The choice's finish reason; "tool_calls" for one that stopped after calls."""
    if out.finish is None:
        return None
    kind = str(out.finish.get("type"))
    return "tool_calls" if calls and kind == "stop" else kind


def abort_error(out: Output) -> dict:
    status = out.status
    return {"message": str(out.finish.get("message", "aborted")),
            "type": "invalid_request_error" if 400 <= status < 500 else "server_error",
            "code": status}


def usage(outs: list[Output], n: int) -> dict:
    """A prompt counts once however many copies of it ran, its cached tokens too
    (prompt_tokens_details, as SGLang's, once the workers report them)."""
    firsts = [o for o in outs if o.index % n == 0]
    prompt = sum(o.prompt_tokens for o in firsts)
    completion = sum(o.completion_tokens for o in outs)
    counts = {"prompt_tokens": prompt, "completion_tokens": completion,
              "total_tokens": prompt + completion}
    if any("cached_tokens" in o.meta for o in outs):
        cached = sum(int(o.meta.get("cached_tokens", 0)) for o in firsts)
        counts["prompt_tokens_details"] = {"cached_tokens": cached}
    return counts
