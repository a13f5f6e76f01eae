"""The HTTP front's streamed events written from fragments (issue 47, item 4): each is
the event the whole formatting gives (native_answer / native_delta / Answer.chunk),
for chunks of any size, text that ends mid-character, stop strings and several
weight versions; a stream's events add up to the answer that does not stream; the
reader's chunks of one turn of the loop make one event per request; the inter-token
histograms count as prometheus_client's do."""
from __future__ import annotations

import asyncio
import random

import orjson
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from engines.formats.tokenizer import Tokenizer
from engines.models.tiny import tiny_tokenizer
from engines.sampling_params import SamplingParams
from tests.unit.http_fake import FakeBackend, call, chunk, front, tiny_answer
from zpd.http.native_format import CumulativeEvents, NativeEvents, native_answer, native_delta
from zpd.http.openai_format import Answer
from zpd.http.output import Detokenizer, Output
from zpd.http.records import GenRequest
from zpd.http.sglang_metrics import TokenHistogram

TOK = tiny_tokenizer()
TEXT = "héllo wörld, 日本語 ✓ ok END and more"


def chunks(rng: random.Random, finish: bool = True) -> list[dict]:
    """TEXT's ids in chunks of 1-3 tokens, versions v1 then v2, the last finished."""
    ids = TOK.encode(TEXT, add_special_tokens=False)
    out, at = [], 0
    while at < len(ids):
        step = rng.randint(1, 3)
        part = ids[at:at + step]
        out.append(chunk("r7", part) | {"weight_versions": ["v1" if at < 9 else "v2"] * len(part)})
        at += step
    if finish:
        out[-1] |= {"finished": True, "finish_reason": {"type": "length"},
                    "meta": {"prompt_tokens": 2, "completion_tokens": len(ids)}, "text": TEXT}
    return out


def request(**sampling) -> GenRequest:
    return GenRequest(SamplingParams.from_dict(sampling), input_ids=[1, 2], rid="r7", stream=True)


def parsed(data: bytes) -> dict:
    assert data.startswith(b"data: ") and data.endswith(b"\n\n") and data.count(b"\n\n") == 1
    return orjson.loads(data[6:])


def without_latency(event: dict) -> dict:
    return event | {"meta_info": {k: v for k, v in event["meta_info"].items() if k != "e2e_latency"}}


def test_generate_events_are_the_whole_formattings_cumulative_and_incremental():
    for seed in range(12):
        for sampling in ({}, {"stop": ["END"]}):
            for budget in (None, 1 << 30, 40):      # incremental; cumulative, each due; spaced
                for batch in (False, True):
                    fast, slow = Output(3, request(**sampling), TOK), Output(3, request(**sampling), TOK)
                    events = NativeEvents(batch, budget and CumulativeEvents(budget))
                    reference = budget and CumulativeEvents(budget)
                    for c in chunks(random.Random(seed)):
                        fast.add(c)
                        slow.add(c)
                        got = events.render(fast)
                        want = native_delta(slow) if reference is None else reference.answer(slow)
                        assert (got is None) == (want is None), (seed, sampling, c)
                        if want is None:
                            continue
                        want = want | {"index": 3} if batch else want
                        assert without_latency(parsed(got)) == without_latency(want)
                        if reference is not None:
                            reference.sent(slow, len(got))


def test_incremental_generate_pieces_add_up_to_the_whole_answer():
    out, events = Output(0, request(stop=["END"]), TOK), NativeEvents(False, None)
    text, ids, versions = "", [], []
    for c in chunks(random.Random(5)):
        out.add(c)
        data = events.render(out)
        if data:
            e = parsed(data)
            text, ids = text + e["text"], ids + e["output_ids"]
            versions += e["meta_info"]["output_token_weight_versions"]
    whole = native_answer(out)
    assert (text, ids, versions) == (whole["text"], whole["output_ids"],
                                     whole["meta_info"]["output_token_weight_versions"])


def test_openai_events_are_the_whole_formattings():
    for chat in (True, False):
        answer = Answer("tiny", chat, None)
        for seed in range(6):
            fast, slow = Output(1, request(), TOK), Output(1, request(), TOK)
            first = True
            for c in chunks(random.Random(seed)):
                fast.add(c)
                slow.add(c)
                got = answer.event(fast, fast.new_text(), fast.new_tokens(), first, "", True)
                want = answer.chunk(slow, slow.new_text(), slow.new_tokens(), first, "", True)
                assert parsed(got) == want
                first = False


def test_a_stream_that_does_not_wait_for_its_text_decodes_only_at_the_end():
    lazy = Detokenizer(TOK, incremental=False)
    ids = TOK.encode(TEXT, add_special_tokens=False)
    for i in range(0, len(ids), 2):
        lazy.add(ids[i:i + 2])
    assert lazy.text == "" and lazy.ids == ids and lazy.whole() == TEXT
    assert TOK.decode_one(ids[0]) == TOK.decode(ids[:1]) == TOK.decode_one(ids[0])


def test_byte_level_texts_joined_are_what_a_decode_from_the_last_stable_point_gives():
    """A byte-level tokenizer's texts are joined where nothing waits for more bytes;
    any ids (broken UTF-8, characters split over tokens, special tokens) give the text
    the decode from the last stable point gives."""
    plain = Tokenizer(TOK.inner)
    plain.joins = False
    assert TOK.joins
    rng = random.Random(1)
    whole = list(TOK.encode(TEXT, add_special_tokens=False))
    for trial in range(200):
        ids = [rng.choice((rng.randrange(258), rng.choice(whole))) for _ in range(rng.randint(1, 40))]
        for skip in (True, False):
            fast, slow, at = Detokenizer(TOK, skip), Detokenizer(plain, skip), 0
            while at < len(ids):
                step = rng.randint(1, 3)
                fast.add(ids[at:at + step])
                slow.add(ids[at:at + step])
                at += step
                assert fast.text == slow.text, (ids, skip)


class Burst(FakeBackend):
    """Hands every request's chunks to its sink all in one turn of the loop, as the
    router client's reader does with the messages waiting on its socket."""

    def open(self, req, sink):
        rid = req.rid or f"r{len(self.requests)}"
        self.requests.append(req)
        script = self.script(req, rid)

        async def feed() -> None:
            await asyncio.sleep(0.01)
            for c in script[:-1]:
                sink(c)                  # one turn: all but the last
            await asyncio.sleep(0.01)
            sink(script[-1])
        task = asyncio.ensure_future(feed())
        return task.cancel


def test_the_chunks_of_one_turn_make_one_event_per_request():
    backend = Burst(lambda req, rid: tiny_answer(req, rid, [72, 105, 33, 32, 72, 105]))
    body = {"input_ids": [[1], [2]], "stream": True, "sampling_params": {"max_new_tokens": 6}}
    status, events = call(front(backend), "POST", "/generate", body)
    assert status == 200 and events[-1] == "[DONE]"
    for index in (0, 1):
        mine = [e for e in events[:-1] if e["index"] == index]
        # the first five tokens in one event, the last with the end
        assert [len(e["output_ids"]) for e in mine] == [5, 6], mine
        assert mine[-1]["text"] == "Hi! Hi"
    status, chat = call(front(backend), "POST", "/v1/completions",
                        {"prompt": [1], "stream": True, "max_tokens": 6})
    texts = [e["choices"][0]["text"] for e in chat[:-1]]
    assert status == 200 and texts == ["Hi! H", "i"], chat


def test_token_histograms_count_as_prometheus_clients_do():
    values = [0.0005, 0.002, 0.0021, 0.05, 3.0, 100.0, 0.002]
    texts = []
    for kind in (Histogram, TokenHistogram):
        registry = CollectorRegistry()
        h = kind("itl_seconds", "doc", ["model_name"], buckets=(0.001, 0.002, 0.01, 1.0),
                 registry=registry).labels("m")
        for v in values[:4]:
            h.observe(v)
        generate_latest(registry)                    # collected between observations
        for v in values[4:]:
            h.observe(v)
        if kind is TokenHistogram:
            h.observe_many(0.5, 3)
        else:
            for _ in range(3):
                h.observe(0.5)
        texts.append([line for line in generate_latest(registry).decode().splitlines()
                      if "_created" not in line])
    assert texts[0] == texts[1] and 'itl_seconds_bucket{le="0.002",model_name="m"} 3.0' in texts[0]


class Unwritable:
    """An EventStream whose writes never go straight out (not yet open, or holding
    bytes unsent): every event must reach `write`, in order."""

    def __init__(self) -> None:
        self.written = b""

    def write_now(self, data: bytes) -> bool:
        return False

    def backlogged(self) -> bool:
        return False

    async def write(self, data: bytes) -> None:
        self.written += data


def test_events_the_reader_cannot_write_wait_for_the_task_none_lost():
    async def go() -> bytes:
        events = Unwritable()
        loop = asyncio.get_running_loop()

        class Backend(FakeBackend):
            def open(self, req, sink):
                def feed(chunks: list[dict]) -> None:    # one chunk per turn, the task's
                    sink(chunks[0])                      # wake-up still to come
                    if chunks[1:]:
                        loop.call_soon(loop.call_soon, feed, chunks[1:])
                loop.call_soon(feed, tiny_answer(req, "r0", [72, 105, 33, 32, 72, 105]))
                return lambda: None
        answer = Answer("tiny", False, None)

        def render(out: Output) -> bytes:
            return answer.event(out, out.new_text(), out.new_tokens(), False)
        from zpd.http.streams import pump
        await pump(Backend(), [request()], TOK, events, render)
        return events.written
    texts = [orjson.loads(e[6:])["choices"][0]["text"] for e in asyncio.run(go()).split(b"\n\n") if e]
    assert "".join(texts) == "Hi! Hi" and len(texts) >= 2, texts
