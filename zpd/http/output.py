"""One request's answer as its chunks arrive: token ids, weight versions, logprobs and
the text so far, for the routes to format (streamed piece by piece or whole).

The workers send token ids; the text is decoded here with the model's tokenizer,
incrementally, so each chunk costs a couple of short decodes whatever the length.
Text is only ever shown once it cannot change: a token that ends inside a UTF-8
character waits for the rest, and with stop strings the last characters wait until
no stop string can still end in them (the workers cut the final text before the
stop string they matched, so what was streamed stays a prefix of the final text).
"""
from __future__ import annotations

import time

from engines.formats.tokenizer import Tokenizer
from zpd.http.records import BadRequest, GenRequest

REPLACEMENT = "\ufffd"      # what a decode shows for a token that ends mid-character
# What one token id or logprob entry costs an answer, about, as the front holds and
# formats it ([logprob, id, null] in JSON is ~30 bytes): what --max-answer-bytes counts.
ENTRY_BYTES = 32
# a finished request's routed experts (engines/routed.py), base64, as SGLang answers them
ROUTED_KEYS = ("routed_experts", "routed_expert_weights")
PROMPT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


class Detokenizer:
    """Token ids -> text, one piece at a time. Each step decodes from the token before
    the last stable point, so tokenizers whose pieces depend on their left neighbour
    (SentencePiece's leading spaces) come out as a whole decode would. Not
    `incremental` (a request that does not stream), it only keeps the ids: its text
    is decoded once, at the end (`whole`)."""

    def __init__(self, tokenizer: Tokenizer | None, skip_special: bool = True,
                 incremental: bool = True) -> None:
        self.tokenizer, self.skip_special = tokenizer, skip_special
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0      # ids[prefix:read] is what `text` last ended with
        self._before = ""                  # ... decoded
        self._decode = None if tokenizer is None or not incremental else tokenizer.decode

    def add(self, ids: list[int]) -> None:
        self.ids += ids
        if self._decode is None or not ids:
            return
        if self.tokenizer.joins and self._read == len(self.ids) - len(ids):
            # nothing waits for more bytes: whole characters are their tokens' texts
            one, skip = self.tokenizer.decode_one, self.skip_special
            last = one(ids[-1], skip)
            pieces = last if len(ids) == 1 else "".join([one(t, skip) for t in ids])
            if REPLACEMENT not in pieces:
                self.text += pieces
                self._prefix, self._read, self._before = len(self.ids) - 1, len(self.ids), last
                return
        after = self._decode(self.ids[self._prefix:], self.skip_special)
        if len(after) > len(self._before) and not after.endswith(REPLACEMENT):
            self.text += after[len(self._before):]
            self._prefix, self._read = self._read, len(self.ids)
            # one token since the last stable point (most steps): its text is known
            self._before = self.tokenizer.decode_one(self.ids[-1], self.skip_special) \
                if self._read - self._prefix == 1 else \
                self._decode(self.ids[self._prefix:], self.skip_special)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids, self.skip_special)

    def whole(self) -> str:
        """Every id decoded at once (the final text when the stop string stays)."""
        return self.decode(self.ids)


class Output:
    """What one request (`index` in its answer) has produced so far."""

    def __init__(self, index: int, req: GenRequest, tokenizer: Tokenizer | None,
                 incremental: bool = True) -> None:
        """`incremental`: the text is shown as it comes (a stream); else it is decoded
        once, at the end, and a chunk costs appending its ids."""
        self.index, self.req, self.tokenizer = index, req, tokenizer
        self.rid = req.rid or ""
        self.token_ids: list[int] = []
        self.weight_versions: list[str] = []
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []
        self.ids_logprobs: list[list[tuple[int, float]]] = []    # token_ids_logprob's
        self.finish: dict | None = None
        self.meta: dict = {}
        self.detok = Detokenizer(tokenizer, req.skip_special, incremental)
        self.finished_at: float | None = None
        self._final_text: str | None = None
        self._hold = max(map(len, req.stop), default=1) - 1   # chars a stop string may still take
        self._shown = 0                  # characters of text already streamed
        self._tokens_shown = 0           # tokens already streamed
        self._offsets = [0]              # where each token's text starts (logprobs)
        self.queued = False              # waiting for the route's task (streams.follow)
        self.failure: Exception | None = None   # a chunk that could not be taken
        self.held = 0                    # the answer's size so far, about (ENTRY_BYTES)

    def add(self, chunk: dict) -> None:
        """Take the next chunk of this request (zpd.Client.stream's shape)."""
        self.rid = chunk["rid"]
        ids = chunk["token_ids"]
        self.token_ids += ids
        self.weight_versions += chunk["weight_versions"]
        self.detok.add(ids)
        self.held += ENTRY_BYTES * len(ids)
        if chunk["finished"] or len(chunk) > 4:     # logprobs, or the end
            self._add_rest(chunk)

    def _add_rest(self, chunk: dict) -> None:
        """A chunk's logprobs, and its end."""
        logprobs = chunk.get("logprobs") or []
        self.logprobs += logprobs
        for mine, key in ((self.top_logprobs, "top_logprobs"), (self.ids_logprobs, "token_ids_logprobs")):
            mine += [[(int(t), float(lp)) for t, lp in row] for row in chunk.get(key) or []]
        self.held += ENTRY_BYTES * (len(logprobs) + sum(
            len(row) for key in ("top_logprobs", "token_ids_logprobs") for row in chunk.get(key) or ()))
        if chunk["finished"]:
            self.finish, self.meta = chunk["finish_reason"], chunk.get("meta") or {}
            self.held += ENTRY_BYTES * _prompt_entries(self.meta) + sum(
                len(self.meta.get(k) or "") for k in ROUTED_KEYS)
            self.finished_at = time.monotonic()
            self._final_text = self._finished_text(chunk.get("text"))

    def _finished_text(self, worker_text: str | None) -> str:
        """The final text, as SGLang trims it unless no_stop_trim: without a matched
        stop string, and without a matched stop token's text (its id stays in
        output_ids). The workers' text is that where it skips special tokens; else it
        is decoded here (without a tokenizer here, the workers' is all there is)."""
        if self.tokenizer is None:
            return (worker_text or "") if self.req.trim_stop else ""
        if not self.req.trim_stop:
            return self.detok.whole()
        matched = (self.finish or {}).get("matched")
        if type(matched) is int and self.token_ids and self.token_ids[-1] == matched:
            return self.detok.decode(self.token_ids[:-1])
        if self.req.skip_special and worker_text is not None:
            return worker_text
        text = self.detok.whole()
        if type(matched) is str and matched in text:
            return text[:text.index(matched)]
        return text

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def aborted(self) -> bool:
        return self.finished and self.finish.get("type") == "abort"

    @property
    def status(self) -> int:
        return int(self.finish.get("status_code", 500)) if self.aborted else 200

    def refusal(self) -> BadRequest | None:
        """The HTTP error to answer if it never ran (None: it ran, or is running): the
        workers refused it as a bad request (400), or the router's queue did (429 full,
        503 timeout, with `retry_after`, which becomes the Retry-After header)."""
        if not self.aborted or self.token_ids:
            return None
        message = str(self.finish.get("message", "bad request"))
        if self.status == 400:
            return BadRequest(message)
        if self.status in (429, 503) and "retry_after" in self.finish:
            return BadRequest(message, self.status, "server_error")
        return None

    @property
    def text(self) -> str:
        """The final text once finished; before, the part that can no longer change."""
        if self._final_text is not None:
            return self._final_text
        text = self.detok.text
        return text[:max(0, len(text) - self._hold)] if self._hold else text

    def new_text(self) -> str:
        """Text not yet streamed (advances)."""
        text = self.text
        piece = text[self._shown:]
        self._shown = max(self._shown, len(text))
        return piece

    def new_tokens(self) -> range:
        """Indices of the tokens not yet streamed (advances)."""
        start, self._tokens_shown = self._tokens_shown, len(self.token_ids)
        return range(start, self._tokens_shown)

    @property
    def prompt_tokens(self) -> int:
        """The workers count it (a text or chat prompt is tokenized there); until the
        final chunk, a prompt of ids counts itself."""
        return int(self.meta.get("prompt_tokens", len(self.req.input_ids or ())))

    @property
    def completion_tokens(self) -> int:
        return int(self.meta.get("completion_tokens", len(self.token_ids)))

    def text_offsets(self, tokens: range) -> list[int]:
        """Where the text of each token of `tokens` starts, counting each token's own
        text (what logprobs name it) from the start of the output."""
        while len(self._offsets) < tokens.stop:
            i = len(self._offsets) - 1
            self._offsets.append(self._offsets[-1] + len(self.token_text(self.token_ids[i])))
        return [self._offsets[i] for i in tokens]

    def token_text(self, token_id: int) -> str:
        return "" if self.tokenizer is None else self.tokenizer.token_text(token_id)

    @property
    def e2e_latency(self) -> float:
        """Seconds from the front taking the request to its end (or to now)."""
        return (self.finished_at or time.monotonic()) - self.req.received


# SGLang's err_type of an abort, from zpd's status codes (its HTTP errors' class names).
ERR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 409: "ConflictError",
             413: "BadRequestError", 429: "TooManyRequestsError", 499: None, 500: "InternalServerError",
             503: "ServiceUnavailableError", 504: "TimeoutError"}


def finish_reason(out: Output) -> dict | None:
    """The finish reason in SGLang's shape: a length finish says its length, an abort
    its err_type."""
    finish = out.finish
    if finish is None:
        return None
    if finish.get("type") == "length":
        return finish | {"length": out.completion_tokens}
    if finish.get("type") == "abort":
        return finish | {"err_type": ERR_TYPES.get(out.status, "InternalServerError")}
    return finish


def version_spans(versions: list[str], start: int = 0) -> list[dict]:
    """Per-token weight versions as SGLang's spans: each run of one version is
    {"version", "start", "end"} over output token positions, `end` exclusive;
    `versions` are those of the tokens from position `start` on."""
    if versions and versions.count(versions[0]) == len(versions):     # one version (most)
        return [{"version": versions[0], "start": start, "end": start + len(versions)}]
    spans: list[dict] = []
    for i, v in enumerate(versions, start):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    return spans


def meta_info(out: Output, tokens: range | None = None) -> dict:
    """SGLang's meta_info for one request (logprobs aside): `weight_versions` are its
    spans, zpd's per-token list is `output_token_weight_versions`; both only of the
    output tokens in `tokens` when given (an incremental event), the counts whole."""
    every = out.weight_versions
    tokens = range(len(every)) if tokens is None else tokens
    versions = every[tokens.start:tokens.stop] if tokens.start or tokens.stop < len(every) \
        else every
    return {"id": out.rid, "finish_reason": finish_reason(out),
            "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
            "cached_tokens": int(out.meta.get("cached_tokens", 0)),
            "e2e_latency": out.e2e_latency,
            # a scored prompt (max_new_tokens 0) has no token: its prefill names the weights
            "weight_version": every[-1] if every else out.meta.get("weight_version"),
            "weight_versions": version_spans(versions, tokens.start),
            "output_token_weight_versions": versions,
            "retractions": int(out.meta.get("retractions", 0))} | {
                k: out.meta[k] for k in ROUTED_KEYS if k in out.meta}   # the final chunk's


def _prompt_entries(meta: dict) -> int:
    """The prompt logprob entries a finished request's meta carries."""
    rows = meta.get("input_token_logprobs") or ()
    alternatives = sum(len(r or ()) for key in PROMPT_KEYS[1:] for r in meta.get(key) or ())
    return len(rows) + alternatives
