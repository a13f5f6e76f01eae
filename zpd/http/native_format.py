"""SGLang's native answers (`POST /generate`): one request's answer, whole or as
stream events, from its Output.

A stream's events (`NativeEvents`) are SGLang's: by default each carries the text,
output_ids and logprobs so far (spaced: CumulativeEvents), with
--incremental-streaming-output only what is new since the last. An event of a
request without logprobs, not its last, is written from fragments kept per request
(`Fragments`: its ids, weight versions and text as JSON, each token's appended once),
so an event costs its new tokens and a copy of the bytes, not a formatting of
everything so far; the others (and every last event) are formatted whole from
`native_answer` / `native_delta`, as an answer that does not stream is.
"""
from __future__ import annotations

import orjson

from zpd.http.output import Output, meta_info


def native_answer(out: Output, text_in_logprobs: bool | None = None,
                  triples: Triples | None = None) -> dict:
    """One request's answer (or its progress so far) in SGLang's shape; `triples`: its
    logprobs as formatted for the events before (a cumulative stream's). Logprobs name
    their tokens' text where `text_in_logprobs` says, by default where the request asked."""
    return _answer(out, out.text, range(len(out.token_ids)), text_in_logprobs, triples)


def native_delta(out: Output, text_in_logprobs: bool | None = None) -> dict | None:
    """What SGLang's --incremental-streaming-output sends: the text, output_ids,
    logprobs and weight versions new since the last (counts in meta_info stay whole);
    None when nothing is new."""
    text, tokens = out.new_text(), out.new_tokens()
    if not (text or tokens or out.finished):
        return None
    return _answer(out, text, tokens, text_in_logprobs)


def _answer(out: Output, text: str, tokens: range, text_in_logprobs: bool | None,
            triples: Triples | None = None) -> dict:
    if text_in_logprobs is None:
        text_in_logprobs = out.req.text_in_logprobs
    meta = meta_info(out, tokens)
    ids = out.token_ids[tokens.start:tokens.stop]
    if out.req.logprobs:
        if triples is None or tokens.start:
            triples = Triples(tokens.start)
        triples.extend(out, tokens.stop, text_in_logprobs)
        meta["output_token_logprobs"] = triples.tokens
        if out.req.top_logprobs:
            meta["output_top_logprobs"] = triples.tops
        if out.req.token_ids_logprob:
            meta["output_token_ids_logprobs"] = triples.ids
        meta |= prompt_triples(out, text_in_logprobs)
    return {"text": text, "output_ids": ids, "meta_info": meta}


def prompt_triples(out: Output, text_in_logprobs: bool) -> dict:
    """The prompt's logprobs the workers sent with the finished request (engine's
    input_* fields) as SGLang's [logprob, token_id, text] triples; null entries stay."""
    def named(token_id: int) -> str | None:
        return out.token_text(token_id) if text_in_logprobs else None

    def row(pairs: list | None) -> list | None:
        return None if pairs is None else [[lp, t, named(t)] for t, lp in pairs]
    got = {}
    if "input_token_logprobs" in out.meta:
        got["input_token_logprobs"] = [[lp, t, named(t)] for lp, t in out.meta["input_token_logprobs"]]
    for key in ("input_top_logprobs", "input_token_ids_logprobs"):
        if key in out.meta:
            got[key] = [row(pairs) for pairs in out.meta[key]]
    return got


class Triples:
    """An Output's logprobs from token `start` on as SGLang's [logprob, token_id, text]
    triples (text null unless return_text_in_logprobs): each token's, its top
    alternatives', its token_ids_logprob ids'. Each is formatted once: a
    cumulative event extends the lists of the one before (formatting them all again
    for every event cost 30x what serializing them does)."""

    def __init__(self, start: int = 0) -> None:
        self.start = start
        self.tokens: list[list] = []
        self.tops: list[list[list]] = []
        self.ids: list[list[list]] = []

    def extend(self, out: Output, stop: int, text_in_logprobs: bool) -> None:
        def named(token_id: int) -> str | None:
            return out.token_text(token_id) if text_in_logprobs else None
        for i in range(self.start + len(self.tokens), min(stop, len(out.logprobs))):
            t = out.token_ids[i]
            self.tokens.append([out.logprobs[i], t, named(t)])
        for rows, got in ((self.tops, out.top_logprobs), (self.ids, out.ids_logprobs)):
            for i in range(self.start + len(rows), min(stop, len(got))):
                rows.append([[lp, t, named(t)] for t, lp in got[i]])


class CumulativeEvents:
    """A stream's cumulative events (SGLang's default), and when each is due. Each
    carries everything so far, so one per token would write O(n^2) bytes over a
    request (4,000 tokens with top-20 logprobs: GBs); instead an event is due once the
    tokens since the last one pay for its size at `budget` bytes each. The first and
    the last event always come, and the last carries the whole answer, so a client
    that reads each event as the state so far (SGLang's clients do) sees the same
    answer, in fewer steps once it is long."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.last: dict[int, tuple[int, int]] = {}    # index -> (tokens, bytes) at its last event
        self.triples: dict[int, Triples] = {}         # index -> its logprobs, formatted once

    def answer(self, out: Output) -> dict | None:
        """The event of `out` if one is due."""
        if not self.due(out):
            return None
        return native_answer(out, None, self.triples.setdefault(out.index, Triples()))

    def due(self, out: Output) -> bool:
        if out.finished or out.index not in self.last:
            return True
        tokens, size = self.last[out.index]
        return (len(out.token_ids) - tokens) * self.budget >= size

    def sent(self, out: Output, size: int) -> None:
        self.last[out.index] = (len(out.token_ids), size)


class Fragments:
    """One request's output so far as JSON fragments: its ids, per-token weight
    versions and shown text (escaped, without the quotes), each token's appended once;
    its version spans, and their JSON up to the last one's end."""
    __slots__ = ("tokens", "ids", "versions", "spans", "spans_head", "chars", "text", "rid",
                 "head")

    def __init__(self) -> None:
        self.tokens = self.chars = 0           # tokens and characters taken so far
        self.ids, self.versions, self.text = bytearray(), bytearray(), bytearray()
        self.spans: list[dict] = []
        self.spans_head = b""
        self.rid, self.head = None, b""        # meta_info's opening, for this rid

    def restart(self, start: int) -> None:
        """Forget what was taken: the next take is of the tokens from `start` on, and
        the text not yet shown (an incremental event's)."""
        self.ids.clear(), self.versions.clear(), self.text.clear(), self.spans.clear()
        self.tokens = start

    def take(self, out: Output) -> None:
        """`out`'s tokens and shown text since the last take (advances out.new_text)."""
        start, stop = self.tokens, len(out.token_ids)
        if stop > start:
            comma = b"," if self.ids else b""
            self.ids += comma + orjson.dumps(out.token_ids[start:stop])[1:-1]
            versions = out.weight_versions[start:stop]
            self.versions += comma + orjson.dumps(versions)[1:-1]
            spans = self.spans
            if spans and versions.count(spans[-1]["version"]) == len(versions):
                spans[-1]["end"] = stop
            else:
                for i, v in enumerate(versions, start):
                    if spans and spans[-1]["version"] == v:
                        spans[-1]["end"] = i + 1
                    else:
                        spans.append({"version": v, "start": i, "end": i + 1})
                last = spans[-1]
                self.spans_head = orjson.dumps(spans[:-1])[:-1] + (b"," if len(spans) > 1 else b"") \
                    + b'{"version":%b,"start":%d,"end":' % (orjson.dumps(last["version"]), last["start"])
            self.tokens = stop
        piece = out.new_text()
        if piece:
            self.text += orjson.dumps(piece)[1:-1]
            self.chars += len(piece)

    def event(self, out: Output, index: bytes) -> bytes:
        """`out`'s event so far (unfinished, without logprobs), as `native_answer` would
        give it: the same keys in the same order."""
        if out.rid != self.rid:
            self.rid = out.rid
            self.head = b'"meta_info":{"id":%b,"finish_reason":null,"prompt_tokens":%d,' % (
                orjson.dumps(out.rid), out.prompt_tokens)
        spans = b"%b%d}]" % (self.spans_head, self.spans[-1]["end"]) if self.spans else b"[]"
        every = out.weight_versions
        version = orjson.dumps(every[-1] if every else out.meta.get("weight_version"))
        return b'data: {"text":"%b","output_ids":[%b],%b"completion_tokens":%d,' \
            b'"cached_tokens":0,"e2e_latency":%b,"weight_version":%b,"weight_versions":%b,' \
            b'"output_token_weight_versions":[%b],"retractions":0}%b}\n\n' % (
                self.text, self.ids, self.head, len(out.token_ids), orjson.dumps(out.e2e_latency),
                version, spans, self.versions, index)


class NativeEvents:
    """The events of one streamed /generate call: `render(out)` gives the event due for
    `out` (serialized), or None. Before the first, a request the workers or the
    router's queue refused raises its HTTP error (Output.refusal) instead."""

    def __init__(self, batch: bool, cumulative: CumulativeEvents | None) -> None:
        self.batch, self.cumulative = batch, cumulative
        self.started = False
        self.fragments: dict[int, Fragments] = {}

    def render(self, out: Output) -> bytes | None:
        if not self.started:
            refused = out.refusal()
            if refused is not None:
                raise refused
        data = self._fast(out) if not out.finished and not out.req.logprobs else self._whole(out)
        if data is not None:
            self.started = True
            if self.cumulative is not None:
                self.cumulative.sent(out, len(data))
        return data

    def _index(self, out: Output) -> bytes:
        return b',"index":%d' % out.index if self.batch else b""

    def _fast(self, out: Output) -> bytes | None:
        """An unfinished event without logprobs, from fragments."""
        cumulative = self.cumulative
        frag = self.fragments.get(out.index)
        if frag is None:
            frag = self.fragments[out.index] = Fragments()
        if cumulative is None:                  # what is new since the last event
            frag.restart(out.new_tokens().start)
            frag.take(out)
            if not (frag.ids or frag.text):
                return None
            return frag.event(out, self._index(out))
        if not cumulative.due(out):
            return None
        frag.take(out)
        return frag.event(out, self._index(out))

    def _whole(self, out: Output) -> bytes | None:
        """The event formatted whole (logprobs, or the last)."""
        if self.cumulative is None:
            answer = native_delta(out)
        else:
            answer = self.cumulative.answer(out)
        if answer is None:
            return None
        return b"data: " + orjson.dumps(answer | {"index": out.index} if self.batch else answer) \
            + b"\n\n"
