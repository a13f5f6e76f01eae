"""Answers in OpenAI's shapes: completions and chat completions, whole or as stream
chunks, with usage and logprobs, from the Outputs of a route's requests.

A completion with `echo` and `logprobs` covers the prompt's tokens first, as vLLM's:
their logprobs are the prefill's (the workers' input_token_logprobs, position 0's
null), followed by the completion's."""
from __future__ import annotations

import itertools
import time
import uuid

from zpd.http.output import Output


class Answer:
    """One OpenAI answer's identity and the formatting of its parts."""

    def __init__(self, model: str, chat: bool, logprobs: int | None, echo: bool = False) -> None:
        self.model, self.chat, self.logprobs, self.echo = model, chat, logprobs, echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

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
            if self.chat:
                choice = {"index": out.index, "message": {"role": "assistant", "content": out.text},
                          "logprobs": self.chat_logprobs(out, every)}
            else:
                choice = {"index": out.index, "text": echo + out.text,
                          "logprobs": self.completion_logprobs(out, every, len(echo), self.echo)}
            choices.append(choice | {"finish_reason": finish_reason(out)})
        return self._head(False) | {"choices": choices, "usage": usage(outs, n)}

    # --- stream chunks ----------------------------------------------------------------

    def chunk(self, out: Output, text: str, tokens: range, first: bool, echo: str = "",
              include_usage: bool = False) -> dict:
        """A stream chunk for one choice: the text and tokens new since its last chunk
        (`first`: its first chunk); its finish_reason once it has finished, with an
        `error` {message, type, code} when it ended in an abort or failure."""
        if self.chat:
            delta = ({"role": "assistant"} if first else {}) | ({"content": text} if text or first else {})
            choice = {"index": out.index, "delta": delta, "logprobs": self.chat_logprobs(out, tokens)}
        else:
            choice = {"index": out.index, "text": (echo if first else "") + text,
                      "logprobs": self.completion_logprobs(out, tokens, len(echo),
                                                           self.echo and first)}
        choice["finish_reason"] = finish_reason(out)
        if out.aborted:
            choice["error"] = abort_error(out)
        return self._head(True) | {"choices": [choice]} | ({"usage": None} if include_usage else {})

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


def finish_reason(out: Output) -> str | None:
    return None if out.finish is None else str(out.finish.get("type"))


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
