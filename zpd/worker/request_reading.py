"""How a worker reads a generate: its prompt (ids, or text and chat through the
model's tokenizer and template, long ones on the tokenizing thread) and its sampling
parameters, checked against the model and the KV pool. A mixin of `WorkerCore`
(zpd/worker/core.py), whose fields it reads."""
from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable, Hashable

from engines.request import validate
from engines.sampler import SamplingParams
from zpd.wire.status import BAD_REQUEST, StatusError
from zpd.worker.tokenizing import is_long


class RequestReading:
    """`read_request_then`, `read_request` and `prompt_ids` of `WorkerCore`."""

    def read_request_then(self, key: Hashable, tag: Any, msg, done: Callable[..., None]) -> None:
        """`done(*read_request(msg), paused_meanwhile)`: now, or for a long text or chat
        later, on the loop, once the tokenizing thread has its ids (zpd/worker/tokenizing.py);
        until then `key` is in `self.tokenizing.pending` with `tag`, and cancelling it
        drops it. A grammar not compiled yet goes to that thread too (compiled there,
        read from the cache here). `paused_meanwhile`: a pause that drops requests
        (retract, abort) was in force at some time in between; the prefill then drops the generate (as one that
        arrived during the pause) and the decode has it recomputed."""
        grammar = None if msg.refused else msg.sampling.constraint
        compiled = self.compute.grammars.compiled(grammar)
        if (msg.input_ids or not is_long(msg.text, msg.chat)) and compiled:
            done(*self.read_request(msg), False)
            return
        seen = -1 if self.dropping else self.drop_pauses

        def work() -> list[int]:      # a new grammar compiles here too (engines/grammar.py)
            if not compiled:
                self.compute.grammars.compile(grammar)
            return self.prompt_ids(msg, on_loop=False)
        self.tokenizing.submit(key, tag, work, lambda got: done(*self.read_request(msg, got),
                                                                seen != self.drop_pauses))

    def read_request(self, msg, tokenized: list[int] | Exception | None = None
                     ) -> tuple[list[int], SamplingParams, StatusError | None]:
        """A generate's prompt and sampling parameters, checked against this worker's
        model and pool; the error (400 unless it says otherwise) instead of raising.
        `tokenized`: the prompt's ids (or why there are none) from the tokenizing thread."""
        prompt, params = [], msg.sampling
        try:
            if msg.refused:
                raise ValueError(msg.refused)
            if isinstance(tokenized, Exception):
                raise tokenized
            prompt = self.prompt_ids(msg) if tokenized is None else tokenized
            validate(prompt, params, self.model.cfg, self.pool.layout.page_size, self.pool.num_pages,
                     self.compute.routed_experts)
            self.compute.grammars.check(params.constraint)
        except StatusError as e:
            return prompt, params, e
        except ValueError as e:
            return prompt, params, StatusError(BAD_REQUEST, str(e))
        return prompt, params, None

    def prompt_ids(self, msg, on_loop: bool = True) -> list[int]:
        """The request's prompt: its token ids, or its text or conversation through our
        tokenizer and chat template (on the loop, a long call: peers must keep hearing
        from us; `on_loop` False on the tokenizing thread, which must not lend the socket)."""
        refusal = self.cfg.prompt_limits.refusal(msg.input_ids, msg.text, msg.chat)
        if refusal is not None:
            raise StatusError(BAD_REQUEST, refusal)
        if msg.input_ids or not (msg.text or msg.chat):
            return list(msg.input_ids)
        with self.long_call() if on_loop else nullcontext():
            if msg.chat:
                return self.model.encode_chat(*chat_parts(msg.chat))
            return self.model.encode(msg.text)


CHAT_KEYS = {"messages", "tools", "chat_template_kwargs"}


def chat_parts(chat: dict) -> tuple[list, list | None, dict | None]:
    """(messages, tools, template variables) of a generate's `chat` field; the chat
    template checks each."""
    if "messages" not in chat or not set(chat) <= CHAT_KEYS:
        raise StatusError(BAD_REQUEST, 'chat must be {"messages": [{"role", "content"}, ...]} '
                          'with optional "tools" and "chat_template_kwargs"')
    return chat["messages"], chat.get("tools"), chat.get("chat_template_kwargs")
