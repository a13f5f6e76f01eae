"""Tokenizing a long text never starves a worker's other threads (issue 30, item 3).

`tokenizers`' `encode` holds the GIL for the whole call: a 1 MiB prompt (the
documented --max-text-bytes) took about a second, the worker's ping responder
thread could not run, and the router declared both workers dead. Our Tokenizer
encodes through `encode_batch`, which releases the GIL. Each test tokenizes
repeatedly for at least MIN_S and counts what another thread got done meanwhile
as a rate, so a faster machine does not make it pass or fail: with the GIL held,
the other thread runs about once per encode call."""
from __future__ import annotations

import threading
import time

import pytest

from engines.models.tiny import tiny_tokenizer
from engines.formats.tokenizer import Tokenizer
from zpd.wire.net import Dealer
from zpd.wire.protocol import Generate, Ping, Pong

# 1 MiB of UTF-8: the most --max-text-bytes allows by default
MIB_TEXT = ("The quick brown fox jumps over the lazy dog; 1234 héllo wörld! \n" * 17_000) \
    .encode()[:1 << 20].decode(errors="ignore")
MIN_S = 1.0            # tokenize at least this long
MAX_CALLS = 50         # ... but never more often than this
SPACING_S = 0.05       # the other thread must get a turn at least this often, on average


def tokenize_for_a_while(tok: Tokenizer, text: str = MIB_TEXT) -> tuple[list[int], float]:
    """Encode `text` again and again for MIN_S; its ids and the time it took."""
    start, ids = time.monotonic(), []
    for _ in range(MAX_CALLS):
        ids = tok.encode(text)
        if time.monotonic() - start >= MIN_S:
            break
    return ids, time.monotonic() - start


@pytest.fixture(params=["tiny", "smollm2"])
def tokenizer(request) -> Tokenizer:
    return tiny_tokenizer() if request.param == "tiny" else request.getfixturevalue("smollm")


def test_a_thread_keeps_ticking_while_a_megabyte_is_tokenized(tokenizer):
    ticks, stop = [], threading.Event()

    def tick() -> None:
        while not stop.wait(0.01):
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        ids, took = tokenize_for_a_while(tokenizer)
    finally:
        stop.set()
        ticker.join()
    assert len(ids) > 100_000
    assert len(ticks) >= took / SPACING_S, f"{len(ticks)} ticks in {took:.2f} s"


def test_encode_gives_the_library_s_own_ids(tokenizer):
    for text in (MIB_TEXT[:5000], "", "<|im_start|>user\nhi<|im_end|>"):
        for special in (True, False):
            assert tokenizer.encode(text, special) == \
                tokenizer.inner.encode(text, add_special_tokens=special).ids


def test_a_worker_answers_pings_while_it_tokenizes_a_megabyte(cluster, monkeypatch):
    """The prefill's scheduler thread tokenizes a 1 MiB prompt (for MIN_S, with the real
    tokenizer); a peer pinging it every 20 ms meanwhile gets pongs throughout, from the
    busy responder (which starts answering after 0.5 s here)."""
    core, tok = cluster.prefill, cluster.prefill.model.tokenizer
    monkeypatch.setattr(tok, "encode", lambda text, special=True: tokenize_for_a_while(
        Tokenizer(tok.inner), text)[0])
    got: dict = {}

    def scheduler_thread() -> None:   # the test thread leaves the core alone meanwhile
        start = time.monotonic()
        try:
            got["ids"] = core.prompt_ids(Generate("long", [], text=MIB_TEXT))
        finally:
            got["took"] = time.monotonic() - start

    prober = Dealer(cluster.ctx, core.endpoint, identity=b"prober")
    worker = threading.Thread(target=scheduler_thread)
    pongs, seq = 0, 0
    try:
        worker.start()
        while worker.is_alive() and seq < 10_000:
            seq += 1
            prober.send(Ping(seq=seq, sent_at=0.0))
            while (msg := prober.recv(timeout=0.02)) is not None:
                pongs += isinstance(msg, Pong)
        worker.join(timeout=60)
    finally:
        prober.close()
    assert len(got["ids"]) > 100_000
    after_s = core.responder.after_s
    assert pongs >= (got["took"] - after_s) / (2 * SPACING_S), \
        f"{pongs} pongs in {got['took']:.2f} s"


def test_a_thread_gets_turns_while_a_megabyte_of_ids_is_decoded(tokenizer):
    """The HTTP front decodes a prompt of ids for echo on a thread of its pool: its
    event loop must get turns meanwhile, so the decode must release the GIL. The
    longest gap between the other thread's turns, as a share of one decode's time
    (holding the GIL, the gap is a whole decode)."""
    ids = tokenizer.encode(MIB_TEXT)
    ticks, stop = [], threading.Event()

    def tick() -> None:
        while not stop.wait(0.002):
            ticks.append(time.monotonic())

    ticker = threading.Thread(target=tick)
    ticker.start()
    calls = []
    try:
        while len(calls) < 5:
            start = time.monotonic()
            assert tokenizer.decode(ids)
            calls.append(time.monotonic() - start)
    finally:
        stop.set()
        ticker.join()
    gap = max(b - a for a, b in zip(ticks, ticks[1:]))
    assert gap < 0.5 * min(calls), f"a {gap * 1e3:.0f} ms gap; one decode takes {min(calls) * 1e3:.0f} ms"
