"""Routed experts larger than a wire frame (zpd/wire/rows.py), in one process
(tests/unit/inproc.py): an answer past the old 2M-value limit and past one 16 MiB frame
equals `zpd run`'s while no frame passes a piece; rows from a worker that does not
answer the request, for a request that asked none, or for no request are dropped by
the router; rows that do not arrive whole fail their request alone."""
from __future__ import annotations

import logging

import orjson
import pytest

from engines.offline import OfflineEngine
from engines.request import Request
from engines.routed_wire import PIECE_BYTES
from engines.sampling_params import SamplingParams
from tests.unit.hf_models import make_checkpoint
from tests.unit.inproc import InprocCluster
from zpd.wire import net
from zpd.wire.protocol import MAX_FRAME_BYTES, PROTOCOL_VERSION, Rows
from zpd.wire.rows import ROWS_META

pytest.importorskip("transformers", reason="the tests' checkpoints are written by transformers")

ASK = {"return_routed_experts": True, "return_routed_expert_weights": True}
KEYS = ("routed_experts", "routed_expert_weights")
# Wide rows, tiny sums: 32 layers x 32 of 64 experts = 1,024 ids per position (Qwen3-30B-
# A3B has 384, GLM-4.5 736), so 1,645 positions are past one frame as SGLang's base64.
WIDE = dict(hidden_size=16, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, num_experts=64, num_experts_per_tok=32, moe_intermediate_size=8,
            num_hidden_layers=32, max_position_embeddings=2048)
OLD_LIMIT = 1 << 21                 # values per answer, weights counted, before pieces


def offline(model, prompt: list[int], new: int, ask: dict) -> dict:
    engine = OfflineEngine(model, kv_cache_mb=16, routed_experts=True)
    (want,) = engine.run([Request("ref", prompt, SamplingParams(
        temperature=0, max_new_tokens=new, ignore_eos=True, **ask))])
    return want


def test_an_answer_wider_than_a_frame_equals_zpd_run(tmp_path, monkeypatch):
    sent: list[tuple[str, list[int]]] = []           # every message encoded: type, frame sizes
    encode = net.encode

    def recording(msg):
        frames = encode(msg)
        sent.append((msg.TYPE, [len(f) for f in frames]))
        return frames
    monkeypatch.setattr(net, "encode", recording)
    c = InprocCluster(model=str(make_checkpoint("qwen3_moe", tmp_path, **WIDE)),
                      routed_experts=True, kv_cache_mb=16)
    try:
        prompt = [(7 * i) % 300 for i in range(1643)]
        got = c.run(c.submit(prompt, 3, stream=False, sampling=ASK))
        want = offline(c.prefill.model, prompt, 3, ASK)
        assert got.status is None and got.token_ids == want["output_ids"]
        for key in KEYS:
            assert got.meta[key] == want["meta"][key], key
        assert ROWS_META not in got.meta
        values = (len(prompt) + 3 - 1) * 32 * 32
        assert 2 * values > OLD_LIMIT
        assert sum(len(got.meta[k]) for k in KEYS) > MAX_FRAME_BYTES
        assert max(size for _, sizes in sent for size in sizes) <= PIECE_BYTES
        decode, relayed = [sizes for kind, sizes in sent if kind == "rows"]   # and the router
        rows = decode
        assert relayed == rows and rows[1] == values and sum(rows[2:]) == 4 * values and len(rows) == 4   # uint8 ids
        (kv,) = [sizes for kind, sizes in sent if kind == "kv_done"]
        assert sum(kv[1:]) == 5 * len(prompt) * 32 * 32 and len(kv) == 4   # ids, 2 pieces of weights
        c.check_pages()
    finally:
        c.close()


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe")))


@pytest.fixture
def routed(moe):
    c = InprocCluster(model=moe, routed_experts=True)
    yield c
    c.close()


PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]


def test_rows_the_router_must_not_pass_are_dropped(routed, caplog):
    """From the prefill for a request its decode answers, from the decode for a request
    that asked none, for no request at all: dropped, and both answers are whole."""
    c = routed
    asked = c.submit(PROMPT, 40, sampling=ASK)
    plain = c.submit(PROMPT[:5], 40)
    def streaming(rid: str) -> bool:
        return rid in c.answers and len(c.answers[rid].token_ids) >= 2
    c.until(lambda: streaming(asked) and streaming(plain))
    router = c.router.identity
    forged = Rows.of(asked, "uint8", bytes(len(PROMPT) * 6), None)
    with caplog.at_level(logging.WARNING, "zpd.router"):
        c.prefill.sock.send(router, forged)
        c.decode.sock.send(router, Rows.of(plain, "uint8", bytes(6), None))
        c.decode.sock.send(router, Rows.of("nobody", "uint8", bytes(6), None))
        c.pump(3)
    dropped = [r.getMessage() for r in caplog.records if "dropping rows" in r.getMessage()]
    assert len(dropped) == 3 and "decode" in dropped[0] and "asked none" in dropped[1], dropped
    assert "no such request" in dropped[2]
    got, other = c.run(asked), c.run(plain)
    want = offline(c.prefill.model, PROMPT, 40, ASK)
    assert got.token_ids == want["output_ids"] and other.status is None
    for key in KEYS:
        assert got.meta[key] == want["meta"][key], key
    assert not set(KEYS) & set(other.meta)
    c.check_pages()


@pytest.mark.parametrize("frames,why", [
    # past the ids an answer may have: 2^25 uint8 ids and one byte more
    ([bytes(1 << 20)] * 31 + [bytes((1 << 20) + 1)], "at most"),
    ([b"\0"] * 33, "out of range"),                   # more pieces than a field may have
])
def test_rows_that_do_not_arrive_whole_fail_their_request_alone(routed, monkeypatch, caplog,
                                                                frames, why):
    c = routed
    send = c.decode.sock.send

    def oversized(identity, msg):       # the decode's rows, made too large on the way
        if not isinstance(msg, Rows):
            return send(identity, msg)
        head = {"v": PROTOCOL_VERSION, "type": "rows", "rid": msg.rid, "dtype": "uint8",
                "ids": [0, len(frames)]}
        c.decode.sock.socket.send_multipart([identity, orjson.dumps(head), *frames])
        return True
    monkeypatch.setattr(c.decode.sock, "send", oversized)
    asked, plain = c.submit(PROMPT, 4, sampling=ASK), c.submit(PROMPT, 4)
    with caplog.at_level(logging.WARNING):
        got, other = c.run(asked), c.run(plain)
    assert why in caplog.text
    assert got.status == 500 and "routed_experts" in got.finish["message"], got.finish
    assert len(got.token_ids) == 4 and not set(KEYS) & set(got.meta)     # its tokens stay
    assert other.status is None and other.token_ids == got.token_ids
    monkeypatch.undo()
    c.check_pages()
    c.serves_again()


@pytest.mark.parametrize("silent_for,new,kept", [
    (0.0, 16, False),        # it runs through the handover, ends before its client resumes
    (4.0, 8, True),          # it ends while no router listens: its decode keeps it whole
])
def test_rows_come_whole_across_a_router_restart(routed, silent_for, new, kept):
    """The new router holds a request's rows for its client until it resumes, whether
    they come from its decode's run or from what the decode kept for the next router."""
    from tests.unit.test_router_restart import restart_router, resume, running
    c = routed
    long = c.submit(PROMPT, 300)                  # its sends find the old router gone
    asked = c.submit(PROMPT[2:], new, stream=False, sampling=ASK)
    running(c, 2)
    restart_router(c, silent_for)
    orphans = c.decode.scheduler.orphans
    assert any(asked in rids for rids in orphans.kept.values()) == kept
    unclaimed = c.router.adoption.unclaimed
    c.until(lambda: asked in unclaimed and unclaimed[asked].backlog is not None)   # it ended
    assert unclaimed[asked].backlog.finished and unclaimed[asked].rows is not None  # held
    resume(c, asked, 0)
    got = c.run(asked)
    want = offline(c.prefill.model, PROMPT[2:], new, ASK)
    assert got.status is None and got.token_ids == want["output_ids"]
    for key in KEYS:
        assert got.meta[key] == want["meta"][key], key
    resume(c, long)
    c.abort(long)
    assert c.run(long).status == 499
    c.check_pages()


def test_a_scored_prompt_gets_its_rows_from_its_prefill(routed):
    """max_new_tokens 0: the prefill answers, and its rows pass the router (prompt - 1
    of them, SGLang's count)."""
    got = routed.run(routed.submit(PROMPT, 0, stream=False, sampling={"return_routed_experts": True}))
    want = offline(routed.prefill.model, PROMPT, 0, {"return_routed_experts": True})
    assert got.status is None and got.meta["routed_experts"] == want["meta"]["routed_experts"]
    assert "routed_expert_weights" not in got.meta
    routed.check_pages()
