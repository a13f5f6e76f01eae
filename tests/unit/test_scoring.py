"""Scoring (max_new_tokens 0): the router sends the request to a prefill alone, which
computes the prompt and answers with its logprobs; no decode, no KV transfer, no
decode pages. Its answer equals `zpd run`'s; it can be aborted, waits out a retract
pause (scored under the weights of continue), ends with 499 in an abort pause and
with 503 when its prefill dies; what no router would send is refused."""
from __future__ import annotations

import pytest
import torch

from engines.models.tiny import tiny_tokenizer
from engines.offline import OfflineEngine
from engines.request import Request
from engines.sampler import SamplingParams
from tests.unit.http_fake import chunk
from tests.unit.inproc import InprocCluster
from zpd.http.native import parse_generate
from zpd.http.native_format import native_answer
from zpd.http.output import Output
from zpd.wire import protocol as p

PROMPT = torch.randint(1, 250, (40,), generator=torch.Generator().manual_seed(11)).tolist()
SCORE = {"max_new_tokens": 0, "return_logprob": True, "logprob_start_len": 0}
INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def _offline(c: InprocCluster, sampling: dict, prompt: list[int] = PROMPT) -> dict:
    params = SamplingParams.from_dict({"temperature": 0} | sampling)
    return OfflineEngine(c.prefill.model, kv_cache_mb=1).run([Request("ref", list(prompt), params)])[0]


def _inputs(meta: dict) -> dict:
    return {k: meta[k] for k in INPUT_KEYS if k in meta}


class DecodeWatch:
    """Every message the decode's socket delivers, and its jobs at every turn."""

    def __init__(self, cluster: InprocCluster) -> None:
        self.got, self.jobs = [], 0
        core, sched = cluster.decode, cluster.decode.scheduler
        real = core._dispatch

        def dispatch(identity, msg):
            self.got.append(type(msg).__name__)
            return real(identity, msg)
        core._dispatch = dispatch
        real_step = sched.step

        def step():
            self.jobs = max(self.jobs, len(sched.jobs))
            return real_step()
        sched.step = step

    @property
    def requests(self) -> list[str]:
        return [t for t in self.got if t in ("Generate", "KvDone", "Recompute", "Abort")]


def test_scored_by_the_prefill_alone_as_zpd_run_scores_it(cluster):
    watch = DecodeWatch(cluster)
    sampling = SCORE | {"top_logprobs_num": 3, "token_ids_logprob": [5, 7]}
    got = cluster.run(cluster.submit(PROMPT, 0, sampling=sampling))
    ref = _offline(cluster, sampling)
    assert got.status is None and got.finish == {"type": "length"}
    assert got.token_ids == [] and got.weight_versions == []
    assert got.meta["completion_tokens"] == 0 and got.meta["prompt_tokens"] == 40
    assert got.meta["weight_version"] == cluster.prefill.model.version
    assert _inputs(got.meta) == _inputs(ref) and len(got.meta["input_token_logprobs"]) == 40
    assert got.meta["input_token_logprobs"][0][0] is None
    assert set(got.meta["timings"]) == {"prefill_queue", "prefill_forward"}
    # the decode never heard of it: no generate, no job, no page, no transfer
    assert watch.requests == [] and watch.jobs == 0
    decode = next(w for w in cluster.admin("status")["workers"] if w["role"] == "decode")
    assert decode["kv_pages"]["free"] == decode["kv_pages"]["total"]
    assert set(decode["queues"].values()) == {0} and decode["peers"] == []
    assert cluster.prefill.status_fields().to_wire()["counters"]["kv_bytes_written"] == 0
    cluster.check_pages()


def test_a_cached_prefix_gives_the_same_answer(cluster):
    first = cluster.run(cluster.submit(PROMPT, 0, sampling=SCORE | {"logprob_start_len": 33}))
    again = cluster.run(cluster.submit(PROMPT, 0, sampling=SCORE | {"logprob_start_len": 33}))
    assert first.meta["cached_tokens"] == 0 and again.meta["cached_tokens"] == 32
    assert _inputs(again.meta) == _inputs(first.meta) == _inputs(_offline(cluster, SCORE | {"logprob_start_len": 33}))
    cluster.check_pages()


def test_beside_generations_in_one_prefill_batch(cluster, monkeypatch):
    """Scored and generated requests queued together are computed in one forward."""
    batches, real = [], cluster.prefill.compute.prefill
    monkeypatch.setattr(cluster.prefill.compute, "prefill",
                        lambda reqs, starts=None: (batches.append([r.rid for r in reqs]), real(reqs, starts)))
    cluster.silent.add("prefill")
    scored = cluster.submit(PROMPT, 0, sampling=SCORE)
    plain = cluster.submit(PROMPT[::-1], 4)           # other prompts: no page to share
    plain_score = cluster.submit(PROMPT[1:21], 0, sampling={"max_new_tokens": 0})
    cluster.pump(5)
    cluster.silent.clear()
    got = {rid: cluster.run(rid) for rid in (scored, plain, plain_score)}
    assert batches[0] == [scored, plain, plain_score]
    assert _inputs(got[scored].meta) == _inputs(_offline(cluster, SCORE))
    assert got[plain].token_ids == _offline(cluster, {"max_new_tokens": 4, "ignore_eos": True},
                                            PROMPT[::-1])["output_ids"]
    assert got[plain_score].token_ids == [] and not _inputs(got[plain_score].meta)
    assert got[plain_score].finish == {"type": "length"}
    cluster.check_pages()


def test_an_abort_ends_it_with_499(cluster):
    cluster.silent.add("prefill")
    rid = cluster.submit(PROMPT, 0, sampling=SCORE)
    cluster.pump(3)
    cluster.abort(rid)
    cluster.pump(3)
    cluster.silent.clear()
    got = cluster.run(rid)
    assert got.status == 499 and got.meta["completion_tokens"] == 0
    assert "input_token_logprobs" not in got.meta
    cluster.check_pages()
    cluster.serves_again()


def _queued_in_a_pause(cluster: InprocCluster, mode: str) -> tuple[str, str]:
    """A scoring request that reached its prefill just before a pause: (rid, the
    pause's admin request id)."""
    cluster.silent.add("prefill")
    rid = cluster.submit(PROMPT, 0, sampling=SCORE)
    cluster.pump(3)
    pause = cluster.admin("pause", wait=False, mode=mode)
    cluster.pump(3)
    cluster.silent.clear()
    cluster.until(lambda: pause in cluster.replies)
    assert cluster.replies[pause]["ok"]
    return rid, pause


def test_a_retract_pause_holds_it_for_the_weights_of_continue(cluster):
    rid, _ = _queued_in_a_pause(cluster, "retract")
    cluster.pump(10)
    assert not cluster.finished(rid)          # held, not scored, not dropped
    assert cluster.admin("update_weight_version", weight_version="v2")["ok"]
    assert cluster.admin("continue")["ok"]
    got = cluster.run(rid)
    assert got.status is None and got.meta["weight_version"] == "v2"
    assert _inputs(got.meta) == _inputs(_offline(cluster, SCORE))    # same weights, new name
    cluster.check_pages()


def test_an_abort_pause_ends_it_with_499(cluster):
    rid, _ = _queued_in_a_pause(cluster, "abort")
    got = cluster.run(rid)
    assert got.status == 499 and "pause(abort)" in got.finish["message"]
    assert cluster.admin("continue")["ok"]
    cluster.serves_again()


def test_waiting_past_its_deadline_ends_it_with_504(cluster, monkeypatch):
    """No pages for it (here: the prefill says none fit): it waits out --kv-wait-timeout
    and its router gets 504, with the counts of a request that generated nothing."""
    monkeypatch.setattr(cluster.prefill.scheduler, "_fits", lambda job: False)
    rid = cluster.submit(PROMPT, 0, sampling=SCORE)
    cluster.pump(5)
    assert not cluster.finished(rid)
    cluster.advance(cluster.prefill.cfg.deadlines.wait_pages + 1.0)
    got = cluster.run(rid)
    assert got.status == 504 and "deadline expired waiting for KV pages" in got.finish["message"]
    assert got.meta["completion_tokens"] == 0 and got.meta["prompt_tokens"] == 40
    assert not cluster.prefill.scheduler.jobs and rid not in cluster.router.inflight
    monkeypatch.undo()
    cluster.check_pages()
    cluster.serves_again()


def test_its_prefill_dying_ends_it_with_503(cluster):
    cluster.silent.add("prefill")
    rid = cluster.submit(PROMPT, 0, sampling=SCORE)
    cluster.advance(3.0)
    got = cluster.run(rid)
    assert got.status == 503 and "prefill" in got.finish["message"]
    cluster.silent.clear()
    cluster.advance(1.0)                      # it answers again; it had the abort
    assert not cluster.prefill.scheduler.jobs
    cluster.serves_again()


def test_router_metrics_count_it_with_no_completion_token(cluster):
    before = cluster.admin("status")["counters"]
    cluster.run(cluster.submit(PROMPT, 0, sampling=SCORE))
    after = cluster.admin("status")["counters"]
    assert after["finished"].get("length", 0) == before["finished"].get("length", 0) + 1
    assert after["generation_tokens"] == before["generation_tokens"]
    assert after["prompt_tokens"] == before["prompt_tokens"] + 40


def test_what_no_router_sends_is_refused(cluster, monkeypatch):
    """A decode-less generate that asks for tokens, and a decode sent a scoring one:
    400 each, nothing computed, nothing held."""
    sent = []
    monkeypatch.setattr(cluster.prefill, "queue_token", lambda to, part, owner="": sent.append(part))
    cluster.prefill.scheduler.on_generate(b"router", p.Generate("x", PROMPT, SamplingParams(max_new_tokens=3), room=5))
    (part,) = sent
    assert part.finish["status_code"] == 400 and "names no decode" in part.finish["message"]
    assert not cluster.prefill.scheduler.jobs
    monkeypatch.undo()
    told = []
    monkeypatch.setattr(cluster.decode, "queue_token", lambda to, part, owner="": told.append(part))
    cluster.decode.scheduler.on_generate(b"router", p.Generate(
        "y", PROMPT, SamplingParams(max_new_tokens=0), room=6, prefill=cluster.prefill.endpoint,
        decode=cluster.decode.endpoint))
    (part,) = told
    assert part.finish["status_code"] == 400 and "prefill alone" in part.finish["message"]
    monkeypatch.undo()
    cluster.pump()
    cluster.check_pages()
    cluster.serves_again()


def test_tokens_only_from_the_worker_that_answers(cluster):
    """The router passes a request's tokens on only from its decode (or, scoring, its
    prefill): another worker cannot end or feed it."""
    cluster.silent.add("prefill")
    rid = cluster.submit(PROMPT, 0, sampling=SCORE)
    cluster.pump(3)
    decode = next(w for w in cluster.router.workers if w.role == "decode")
    cluster.router.relay([p.TokenPart.abort(rid, 500, "forged")], decode)
    cluster.pump(3)
    assert not cluster.finished(rid) and rid in cluster.router.inflight
    cluster.silent.clear()
    assert cluster.run(rid).status is None


def test_generate_body_as_slime_sends_it_for_distillation(cluster):
    """slime's on-policy distillation teacher call: max_new_tokens 0, logprob_start_len
    0, reading meta_info.input_token_logprobs[1:]; SGLang's shape through /generate."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 0, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0}
    parsed = parse_generate(body)
    (item,) = parsed.items
    got = cluster.run(cluster.submit(PROMPT, 0, sampling=item.sampling))
    out = Output(0, item, tiny_tokenizer())
    out.add(chunk("r", got.token_ids, got.finish, got.meta, logprobs=got.logprobs))
    answer = native_answer(out)
    meta = answer["meta_info"]
    teacher = [lp for lp, _, _ in meta["input_token_logprobs"][1:]]
    assert teacher == [v for v, _ in _offline(cluster, SCORE)["input_token_logprobs"][1:]]
    assert len(teacher) == 39 and all(isinstance(v, float) for v in teacher)
    assert answer["text"] == "" and answer["output_ids"] == []
    assert meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    assert meta["finish_reason"] == {"type": "length", "length": 0}
    assert meta["weight_version"] == cluster.prefill.model.version


@pytest.mark.parametrize("sampling", [{"max_new_tokens": 0}, SCORE])
def test_zpd_run_scores_too(cluster, sampling):
    got = _offline(cluster, sampling)
    assert got["output_ids"] == [] and got["meta"]["completion_tokens"] == 0
    assert got["finish_reason"] == {"type": "length"}
    assert ("input_token_logprobs" in got) == ("logprob_start_len" in sampling)


def test_zpd_run_prints_a_scored_prompt(capsys):
    from zpd.ops.cli import main
    assert main(["run", "--model", "tiny", "--input-ids", "1,2,3,4", "--max-new-tokens", "0",
                 "--return-logprob", "--logprob-start-len", "0"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("[run-0 scored: 3 prompt tokens, logprob sum -") and "--json" in line
