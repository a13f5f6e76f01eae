"""The null engine (engines/models/null.py): no weights, no compute, predictable tokens, real
KV pages. In one process (tests/unit/inproc.py) it runs the real router, schedulers and
page handoff, so a test can predict every token without a model to compare with."""
from __future__ import annotations

import json
import threading
import time

import pytest

from engines.compute import Compute
from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.loader import load_model
from engines.config import ModelError
from engines.models.null import PEAK, NullSpec, predict
from engines.prompt_logprobs import PromptLogprobAsk
from tests.unit.inproc import InprocCluster, reference
from transport import FaultRule
from zpd.ops.cli import main
from zpd.wire.net import Dealer
from zpd.wire.protocol import Ping, Pong

FAST = "null:step_ms=0,prefill_us=0,kv_bytes=1024"
PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]   # 17 tokens: 2 pages


@pytest.fixture
def null_cluster():
    c = InprocCluster(model=FAST)
    yield c
    c.close()


# --- the spec ------------------------------------------------------------------------------


def test_spellings():
    assert NullSpec.parse("null") == NullSpec()
    assert NullSpec.parse("null:5") == NullSpec(step_ms=5.0)
    assert NullSpec.parse("null:2.5,seed=3") == NullSpec(step_ms=2.5, seed=3)
    assert NullSpec.parse("null:prefill_us=10,kv_bytes=131072") == \
        NullSpec(prefill_us=10.0, kv_bytes=131072)
    assert NullSpec.parse("null:40,experts=128/8,expert_share=0.9") == \
        NullSpec(step_ms=40.0, experts=(128, 8), expert_share=0.9)


@pytest.mark.parametrize("spec, says", [
    ("null:abc", "every value is a number"), ("null:seed=1.5", "every value is a number"),
    ("null:foo=1", "unknown option 'foo'"), ("null:1,2", "unknown option ''"),
    ("null:step_ms=-1", ">= 0"), ("null:step_ms=nan", ">= 0"), ("null:prefill_us=inf", ">= 0"),
    ("null:kv_bytes=10", "multiple of 16"), ("null:kv_bytes=0", "multiple of 16"),
    ("null:experts=8", "TOTAL/ACTIVE"), ("null:experts=8/x", "TOTAL/ACTIVE"),
    ("null:experts=8/9", "1 <= ACTIVE <= TOTAL"), ("null:experts=0/2", "1 <= ACTIVE <= TOTAL"),
    ("null:experts=8/2,expert_share=1.5", "expert_share is a fraction")])
def test_bad_specs_are_clear_errors(spec, says):
    with pytest.raises(ModelError, match=says):
        load_model(spec)


def test_zpd_run_answers_the_predicted_tokens(capsys):
    assert main(["run", "--model", "null:0", "--prompt", "hello world", "--max-new-tokens", "8",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["output_ids"] == predict(list(b"hello world"), 8)
    assert out["text"] == bytes(predict(list(b"hello world"), 8)).decode()
    assert main(["run", "--model", "null:bogus=1", "--prompt", "hi"]) == 2
    assert "unknown option 'bogus'" in capsys.readouterr().err


def test_a_cluster_at_tp_2_is_refused():
    from engines.tp.spawn import lead
    with pytest.raises(ModelError, match="--tp 1 only"):
        lead("null", "cpu", "float32", None, None, 2)


# --- the runner ------------------------------------------------------------------------------


def _compute(spec: str, dtype: str = "float32") -> Compute:
    model = load_model(spec, dtype=dtype)
    layout = KVLayout.for_model(model.cfg, 16, model.dtype)
    return Compute(model, KVPool(layout, 8, model.dtype, model.device))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_page_bytes_are_as_asked(dtype):
    c = _compute("null:kv_bytes=2048", dtype)
    assert c.pool.layout.page_bytes == 16 * 2048


def test_decode_reads_the_context_from_the_pages():
    """The tokens follow from what the prefill wrote in the pages: copied pages give the
    predicted tokens, empty ones other tokens (what a lost transfer would show)."""
    c = _compute(FAST)
    prompt, pages = PROMPT, [3, 5]
    logits = c.runner.prefill([prompt], [pages])
    first = int(logits.argmax(-1))
    assert first == predict(prompt, 1)[0]
    other = _compute(FAST)
    other.pool.buffer.copy_(c.pool.buffer)                  # what the transport does
    got = other.runner.decode([first], [len(prompt)], [pages])
    assert int(got.argmax(-1)) == predict(prompt, 2)[1]
    empty = _compute(FAST).runner.decode([first], [len(prompt)], [pages])
    assert int(empty.argmax(-1)) != predict(prompt, 2)[1]


def test_a_cached_prefix_continues_the_chain():
    c = _compute(FAST)
    c.runner.prefill([PROMPT[:16]], [[2]])
    logits = c.runner.prefill([PROMPT], [[2, 6]], starts=[16])
    assert int(logits.argmax(-1)) == predict(PROMPT, 1)[0]


def test_forwards_take_the_spec_s_time():
    c = _compute("null:step_ms=30,prefill_us=2000")
    began = time.monotonic()
    c.runner.prefill([PROMPT[:10]], [[0]])
    assert time.monotonic() - began >= 0.020             # 10 tokens x 2 ms
    began = time.monotonic()
    c.runner.decode([1, 2], [10, 10], [[0], [1]])
    assert 0.030 <= time.monotonic() - began < 0.5        # one step, whatever the batch


def test_a_mixtures_step_reads_the_experts_its_batch_chose():
    """experts=E/k: the weights outside the experts plus the expected share of experts
    a batch of B chose, 1 - (1 - k/E)^B; dense: step_ms whatever the batch."""
    dense, moe = NullSpec(step_ms=100), NullSpec(step_ms=100, experts=(128, 8))
    assert dense.step_s(1) == dense.step_s(64) == 0.1
    assert moe.step_s(1) == pytest.approx(0.1 * (0.05 + 0.95 * 8 / 128))     # 0.0109: 3.3B of 30.5B
    assert moe.step_s(2) == pytest.approx(0.1 * (0.05 + 0.95 * (1 - (120 / 128) ** 2)))
    assert moe.step_s(1) < moe.step_s(8) < moe.step_s(64) < moe.step_s(1024) <= 0.1
    assert moe.step_s(1024) == pytest.approx(0.1)
    assert NullSpec(step_ms=100, experts=(8, 8)).step_s(1) == pytest.approx(0.1)   # every expert
    # the runner sleeps out the step of its batch
    c = _compute("null:step_ms=100,experts=64/2,prefill_us=0")
    waited = []
    c.runner._wait = lambda began, seconds: waited.append(seconds)
    c.runner.prefill([PROMPT[:3], PROMPT[3:6]], [[0], [1]])
    c.runner.decode([1], [3], [[0]])
    c.runner.decode([1, 2], [3, 3], [[0], [1]])
    assert waited[1:] == [NullSpec.parse("null:100,experts=64/2").step_s(b) for b in (1, 2)]
    assert waited[1] < waited[2]


# --- a cluster --------------------------------------------------------------------------------


def test_1p1d_answers_the_predicted_tokens(null_cluster):
    c = null_cluster
    rids = [c.submit(PROMPT, 12), c.submit(PROMPT[:3], 20), c.submit(list(range(40)), 5)]
    got = [c.run(r) for r in rids]
    assert [g.token_ids for g in got] == [predict(PROMPT, 12), predict(PROMPT[:3], 20),
                                          predict(list(range(40)), 5)]
    assert got[0].token_ids == reference(c, PROMPT, 12)
    assert got[0].weight_versions == ["null"] * 12 and got[0].finish["type"] == "length"
    c.check_pages()


def test_a_retraction_gives_the_predicted_tokens(null_cluster):
    c = null_cluster
    rid = c.submit(PROMPT, 24)
    c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) >= 4)
    assert c.admin("pause", mode="retract")["ok"]
    c.check_pages(idle=True)
    assert c.admin("continue")["ok"]
    got = c.run(rid)
    assert got.token_ids == predict(PROMPT, 24) and got.meta["retractions"] == 1
    c.check_pages()


def test_retract_update_continue_recomputes_under_the_new_seed(null_cluster):
    c = null_cluster
    rid = c.submit(PROMPT, 24)
    c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) >= 4)
    assert c.admin("pause", mode="retract")["ok"]
    before = list(c.answers[rid].token_ids)
    assert c.admin("update_weights", path="null:seed=7", version="v2")["ok"]
    assert c.admin("continue")["ok"]
    got = c.run(rid)
    n = len(before)
    assert before == predict(PROMPT, n)
    # the recomputed KV is seed 7's: the rest follows from the whole context under it
    assert got.token_ids == before + predict(PROMPT + before, 24 - n, seed=7)
    assert got.weight_versions == ["null"] * n + ["v2"] * (24 - n)
    c.check_pages()


def test_update_from_a_real_model_is_refused(null_cluster):
    got = null_cluster.admin("update_weights", path="tiny")
    assert not got["ok"]
    assert all(w["status"] == 400 and "null spec" in w["error"] for w in got["workers"])
    rid = null_cluster.submit(PROMPT, 4)
    assert null_cluster.run(rid).token_ids == predict(PROMPT, 4)


def test_a_failed_transfer_fails_the_request_and_frees_its_pages():
    c = InprocCluster(model=FAST, fault_plan=FaultRule("fail", count=1, reason="nic down"))
    try:
        got = c.run(c.submit(PROMPT, 8))
        assert got.status == 500 and "nic down" in got.finish["message"]
        c.check_pages()
        assert c.run(c.submit(PROMPT, 8)).token_ids == predict(PROMPT, 8)
    finally:
        c.close()


def test_a_lost_transfer_shows_in_the_tokens():
    """A write that reports success and moves nothing: the decode reads pages the
    prefill never filled, and its tokens leave the prediction after the first."""
    c = InprocCluster(model=FAST, fault_plan=FaultRule("drop", count=1))
    try:
        got = c.run(c.submit(PROMPT, 8))
        assert got.token_ids[0] == predict(PROMPT, 1)[0]      # kv_done carries it
        assert got.token_ids != predict(PROMPT, 8)
        c.check_pages()
    finally:
        c.close()


def test_prompt_logprobs_are_of_the_same_peaked_logits():
    """Token p's logprob is ~0 where the model would have said it, ~-PEAK elsewhere."""
    prompt = [5] + predict([5], 3) + [7 if predict([5], 4)[3] != 7 else 8]
    logits, (got,) = _compute(FAST).runner.prefill_with_logprobs(
        [prompt], [[1]], logprob_from=[PromptLogprobAsk(0, top_k=1)])
    assert got.first == 1 and got.token_logprobs[:3] == pytest.approx([0, 0, 0], abs=1e-6)
    assert got.token_logprobs[3] == pytest.approx(-PEAK, abs=1e-3)
    assert [t[0][0] for t in got.top] == predict([5], 4)
    assert int(logits.argmax(-1)) == predict(prompt, 1)[0]


def test_1p1d_answers_prompt_and_output_logprobs(null_cluster):
    prompt = PROMPT + predict(PROMPT, 2)             # its last two tokens are the model's
    sampling = {"return_logprob": True, "logprob_start_len": 0}
    got = null_cluster.run(null_cluster.submit(prompt, 3, sampling=sampling))
    values = [v for v, _ in got.meta["input_token_logprobs"]]
    assert values[0] is None and values[-2:] == pytest.approx([0, 0], abs=1e-6)
    assert got.token_ids == predict(prompt, 3) and got.logprobs == pytest.approx([0] * 3, abs=1e-6)
    null_cluster.check_pages()


def test_a_long_step_still_answers_pings():
    """The step sleeps as a torch forward computes, off the GIL: the busy responder
    (zpd/worker/busy.py) answers a ping in the middle of it, as for a real forward."""
    c = InprocCluster(model="null:step_ms=1500,prefill_us=0,kv_bytes=1024")
    pong_at: list[float] = []

    def probe() -> None:
        dealer = Dealer(c.ctx, c.decode.endpoint, identity=b"prober")
        time.sleep(0.7)                                  # inside the decode step
        dealer.send(Ping(1, 0.0, "prober"))
        got = dealer.recv(timeout=3.0)
        pong_at.append(time.monotonic() if isinstance(got, Pong) else float("inf"))
        dealer.close()

    try:
        rid = c.submit(PROMPT, 2)
        thread = threading.Thread(target=probe)
        thread.start()
        began = time.monotonic()
        assert c.run(rid).token_ids == predict(PROMPT, 2)
        ended = time.monotonic()
        thread.join()
        assert ended - began >= 1.5 and pong_at[0] < ended - 0.3, (began, pong_at, ended)
    finally:
        c.close()


def test_memory_release_and_resume(null_cluster):
    c = null_cluster
    assert c.admin("release_memory")["ok"] and c.admin("resume_memory")["ok"]
    assert c.run(c.submit(PROMPT, 5)).token_ids == predict(PROMPT, 5)
    c.check_pages()
