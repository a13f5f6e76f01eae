"""Routed experts across prefill and decode in one process (tests/unit/inproc.py, a
Qwen3-MoE checkpoint, float64): the answer equals `zpd run`'s; workers without
--enable-return-routed-experts refuse by name; a kv_done whose routed experts are
missing or out of range fails its request, not the decode."""
from __future__ import annotations

import pytest

from engines.loader import load_model
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampling_params import SamplingParams
from tests.unit.hf_models import make_checkpoint
from tests.unit.inproc import InprocCluster
from tests.unit.test_forged_decode import FakePrefill, Forger, turn
from zpd.wire.protocol import Generate, KvDone

pytest.importorskip("transformers", reason="the tests' checkpoints are written by transformers")

ASK = {"return_routed_experts": True, "return_routed_expert_weights": True}
PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return str(make_checkpoint("qwen3_moe", tmp_path_factory.mktemp("moe")))


@pytest.fixture
def routed(moe):
    c = InprocCluster(model=moe, routed_experts=True)
    yield c
    c.close()


def test_pd_answer_equals_zpd_run(routed):
    rid = routed.submit(PROMPT, 5, sampling=ASK)
    got = routed.run(rid)
    engine = OfflineEngine(routed.prefill.model, kv_cache_mb=1, routed_experts=True)
    (want,) = engine.run([Request("ref", PROMPT, SamplingParams(
        temperature=0, max_new_tokens=5, ignore_eos=True, **ASK))])
    assert got.token_ids == want["output_ids"]
    for key in ("routed_experts", "routed_expert_weights"):
        assert got.meta[key] == want["meta"][key], key
    routed.check_pages()


def test_workers_without_the_flag_refuse_by_name(moe):
    c = InprocCluster(model=moe)
    try:
        got = c.run(c.submit(PROMPT, 3, sampling={"return_routed_experts": True}))
        assert got.status == 400 and "--enable-return-routed-experts" in got.finish["message"]
        assert not got.token_ids
        c.check_pages()
        c.serves_again()
    finally:
        c.close()


@pytest.mark.parametrize("forged,named", [
    ({}, "no routed experts"),                                     # none at all
    ({"routed_experts": [bytes(5)]}, "no routed experts"),           # too few
    ({"routed_experts": [bytes(len(PROMPT) * 3 * 2 * 4)]}, "no routed experts"),  # int32, not uint8
    ({"routed_experts": [b"\x63" * (len(PROMPT) * 3 * 2)]}, "outside"),  # no such expert
])
def test_forged_routed_experts_fail_the_request_not_the_decode(routed, forged, named):
    fake, forger = FakePrefill(routed, f"fake-r{len(forged)}{named[:3]}"), Forger(routed)
    forger.dealer.send(Generate("forged", PROMPT, SamplingParams(
        temperature=0, max_new_tokens=4, ignore_eos=True, return_routed_experts=True),
        False, 21, 0, fake.endpoint, ""))
    turn(routed, fake, forger)
    assert fake.dest(21) is not None
    fake.send(KvDone(21, 0, 5, "tiny", **forged))
    turn(routed, fake, forger)
    finish = forger.finish["forged"]
    assert finish["status_code"] == 500 and named in finish["message"], finish
    routed.check_pages()
    routed.serves_again()


def test_under_expert_and_tensor_parallelism_the_answer_is_the_same(moe):
    """Prefill at --ep 2 (attention whole on both ranks), decode at --tp 2 --ep 2: every
    rank routes every token, the leader's record is the answer, and it equals one
    process's (ranks are processes joined by gloo)."""
    engine = OfflineEngine(load_model(moe, dtype="float64"), kv_cache_mb=1, routed_experts=True)
    (want,) = engine.run([Request("ref", PROMPT, SamplingParams(
        temperature=0, max_new_tokens=5, ignore_eos=True, **ASK))])
    c = InprocCluster(model=moe, routed_experts=True, tp=(1, 2), ep=(2, 2))
    try:
        got = c.run(c.submit(PROMPT, 5, sampling=ASK))
        assert got.token_ids == want["output_ids"]
        for key in ("routed_experts", "routed_expert_weights"):
            assert got.meta[key] == want["meta"][key], key
        c.check_pages()
    finally:
        c.close()
