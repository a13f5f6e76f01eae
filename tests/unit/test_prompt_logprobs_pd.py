"""Prompt logprobs through prefill -> decode (SGLang's input_token_logprobs): the
cluster's equal the runner's and `zpd run`'s; from position k; after a cached prefix;
beside a plain request; across a retraction; a bad start refused with 400."""
from __future__ import annotations

import pytest
import torch

from engines.kv.layout import KVLayout
from engines.kv.pool import KVPool
from engines.models.tiny import tiny_tokenizer
from engines.offline import OfflineEngine
from engines.prompt_logprobs import PromptLogprobAsk
from engines.request import Request, as_float32
from engines.runner import ModelRunner
from engines.sampler import SamplingParams
from tests.unit.http_fake import chunk
from tests.unit.inproc import InprocCluster
from transport import FaultRule
from zpd.client import assemble
from zpd.http.native import parse_generate
from zpd.http.native_format import native_answer
from zpd.http.output import Output
from zpd.http.records import BadRequest
from zpd.wire import protocol as p
from zpd.worker import writes

# 40 tokens: two full 16-token pages the prefix cache can keep, and a part page
PROMPT = torch.randint(1, 250, (40,), generator=torch.Generator().manual_seed(7)).tolist()
ASK = {"return_logprob": True, "logprob_start_len": 0}
INPUT_KEYS = ("input_token_logprobs", "input_top_logprobs", "input_token_ids_logprobs")


def _offline(c: InprocCluster, sampling: dict, max_new: int, prompt: list[int] = PROMPT) -> dict:
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new,
                                       "ignore_eos": True} | sampling)
    return OfflineEngine(c.prefill.model, kv_cache_mb=1).run([Request("ref", list(prompt), params)])[0]


def _inputs(meta: dict) -> dict:
    return {k: meta[k] for k in INPUT_KEYS if k in meta}


def _runner_logprobs(c: InprocCluster, start: int) -> list[float]:
    """ModelRunner.prefill_with_logprobs' own answer, float32 as the wire carries it."""
    model = c.prefill.model
    pool = KVPool(KVLayout.for_model(model.cfg, 16, model.dtype), 16, model.dtype, model.device)
    table = pool.allocator.alloc(pool.pages_for(len(PROMPT)))
    _, (got,) = ModelRunner(model, pool).prefill_with_logprobs([PROMPT], [table], None,
                                                               [PromptLogprobAsk(start)])
    return as_float32(got.token_logprobs)


@pytest.mark.parametrize("start", [0, 1, 21])
def test_cluster_prompt_logprobs_equal_the_runner_and_zpd_run(cluster, start):
    sampling = ASK | {"logprob_start_len": start}
    got = cluster.run(cluster.submit(PROMPT, 3, sampling=sampling))
    ref = _offline(cluster, sampling, 3)
    entries = got.meta["input_token_logprobs"]
    assert [t for _, t in entries] == PROMPT[start:]
    lead = 1 if start == 0 else 0            # position 0 has none (null, as SGLang's)
    assert [v for v, _ in entries[:lead]] == [None] * lead
    assert [v for v, _ in entries[lead:]] == _runner_logprobs(cluster, start)
    assert _inputs(got.meta) == _inputs(ref)
    assert got.token_ids == ref["output_ids"] and got.logprobs == ref["output_token_logprobs"]
    cluster.check_pages()


def test_top_and_token_ids_logprobs_of_the_prompt(cluster):
    sampling = ASK | {"logprob_start_len": 30, "top_logprobs_num": 3, "token_ids_logprob": [4, 9]}
    got = cluster.run(cluster.submit(PROMPT, 2, sampling=sampling))
    ref = _offline(cluster, sampling, 2)
    assert _inputs(got.meta) == _inputs(ref)
    tops, ids = got.meta["input_top_logprobs"], got.meta["input_token_ids_logprobs"]
    assert len(tops) == len(ids) == 10 and all(len(t) == 3 for t in tops)
    assert all([t for t, _ in row] == [4, 9] for row in ids)
    assert all(t[0][1] >= v for t, (v, _) in zip(tops, got.meta["input_token_logprobs"]))


def test_a_cached_prefix_gives_the_same_answer(cluster):
    """The second identical request takes from the cache only the pages before the
    first logit its logprobs read, and answers what the first did."""
    sampling = ASK | {"logprob_start_len": 20}         # reads logits from position 19 on
    first = cluster.run(cluster.submit(PROMPT, 2, sampling=sampling))
    again = cluster.run(cluster.submit(PROMPT, 2, sampling=sampling))
    assert first.meta["cached_tokens"] == 0 and again.meta["cached_tokens"] == 16
    assert _inputs(again.meta) == _inputs(first.meta) and again.token_ids == first.token_ids
    plain = cluster.run(cluster.submit(PROMPT, 2))     # asks nothing: takes both pages
    assert plain.meta["cached_tokens"] == 32 and not _inputs(plain.meta)
    whole = cluster.run(cluster.submit(PROMPT, 2, sampling=ASK))
    assert whole.meta["cached_tokens"] == 0
    assert whole.meta["input_token_logprobs"][20:] == first.meta["input_token_logprobs"]
    cluster.check_pages()


def test_beside_a_plain_request_in_one_batch(cluster):
    asking = cluster.submit(PROMPT, 3, sampling=ASK)
    plain = cluster.submit(PROMPT[:-3], 3)
    got, other = cluster.run(asking), cluster.run(plain)
    assert _inputs(got.meta) == _inputs(_offline(cluster, ASK, 3))
    assert not _inputs(other.meta)
    assert other.token_ids == _offline(cluster, {}, 3, PROMPT[:-3])["output_ids"]
    cluster.check_pages()


def test_a_retraction_keeps_the_first_answer(cluster):
    sampling = ASK | {"top_logprobs_num": 2}
    rid = cluster.submit(PROMPT, 12, sampling=sampling)
    cluster.until(lambda: rid in cluster.answers and len(cluster.answers[rid].token_ids) >= 3)
    held = cluster.decode.scheduler.by_rid[rid].req
    before = held.prompt_logprobs
    assert cluster.admin("pause", mode="retract")["ok"]
    assert cluster.admin("continue")["ok"]
    got = cluster.run(rid)
    assert got.meta["retractions"] == 1 and held.prompt_logprobs is before
    assert _inputs(got.meta) == _inputs(_offline(cluster, sampling, 12))
    cluster.check_pages()


@pytest.mark.parametrize("raw, named", [
    ({"logprob_start_len": 40}, "logprob_start_len 40 must be less than the prompt's length"),
    ({"logprob_start_len": -2}, "logprob_start_len must be"),
    ({"token_ids_logprob": [10 ** 6]}, "token_ids_logprob: token id 1000000 out of range"),
    ({"top_logprobs_num": 20, "token_ids_logprob": [1] * 64}, "39 positions x 85 values each are more than 3000"),
])
def test_bad_prompt_logprob_asks_are_400(cluster, monkeypatch, raw, named):
    monkeypatch.setattr("engines.request.MAX_PROMPT_LOGPROB_ENTRIES", 3000)
    got = cluster.run(cluster.submit(PROMPT, 2, sampling=ASK | raw))
    assert got.status == 400 and named in got.finish["message"]
    cluster.check_pages()


def test_generate_body_to_sglang_meta_info(cluster):
    """/generate's body as slime sends it, through the cluster, in SGLang's shape:
    [logprob, token_id, text] triples, the first position's logprob null."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
            "return_text_in_logprobs": True}
    parsed = parse_generate(body)
    (item,) = parsed.items
    got = cluster.run(cluster.submit(PROMPT, 2, sampling=item.sampling))
    out = Output(0, item, tiny_tokenizer())
    out.add(chunk("r", got.token_ids, got.finish, got.meta, logprobs=got.logprobs,
                  top_logprobs=got.top_logprobs))
    meta = native_answer(out)["meta_info"]
    tok = tiny_tokenizer()
    assert [[v, t, tok.token_text(t)] for v, t in got.meta["input_token_logprobs"]] == \
        meta["input_token_logprobs"]
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == 40
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    assert "input_token_ids_logprobs" not in meta
    assert len(meta["output_token_logprobs"]) == 2


def test_generate_refuses_a_start_past_the_prompt():
    with pytest.raises(BadRequest) as e:
        parse_generate({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2})
    assert "'logprob_start_len' 2 must be less than the prompt's length (2 tokens)" in e.value.message
    plain = parse_generate({"input_ids": [1, 2], "logprob_start_len": 5})   # no logprobs: ignored
    assert "logprob_start_len" not in plain.items[0].sampling.to_wire()


@pytest.mark.parametrize("forged, named", [
    (lambda fields: {}, "no prompt logprobs for positions 1..39"),
    (lambda fields: fields | {"prompt_logprobs": fields["prompt_logprobs"][1:]}, "no prompt logprobs"),
    (lambda fields: {k: v for k, v in fields.items() if "top" not in k}, "no prompt top logprobs"),
])
def test_kv_done_without_the_asked_prompt_logprobs_fails_the_request(cluster, monkeypatch, forged, named):
    """A prefill that leaves them out, or sends too few: the request fails clearly,
    the pages come back, the cluster serves on."""
    real = writes.prompt_logprob_fields
    monkeypatch.setattr("zpd.worker.writes.prompt_logprob_fields", 
                        lambda req: forged(real(req)) if real(req) else {})
    got = cluster.run(cluster.submit(PROMPT, 2, stream=False, sampling=ASK | {"top_logprobs_num": 2}))
    assert got.status == 500 and named in got.finish["message"]
    cluster.pump()
    cluster.check_pages()
    cluster.serves_again()


def test_kv_done_carries_them_as_blobs():
    msg = p.KvDone(1, 0, 5, "v", logprob=[-0.5], prompt_logprobs=[-1.25, -2.0],
                   prompt_top_ids=[3, 4], prompt_top_logprobs=[-0.5, -0.75], prompt_ids_logprobs=[-9.0])
    assert p.decode(p.encode(msg)) == msg
    assert p.decode(p.encode(p.KvDone(1, 0, 5, "v"))).prompt_logprobs is None
    with pytest.raises(p.ProtocolError, match="prompt_top_ids and prompt_top_logprobs"):
        p.KvDone(1, 0, 5, "v", prompt_top_ids=[3])


def test_a_retraction_before_the_kv_asks_them_again():
    """The prefill sent the first token ahead, then a retraction caught the KV: the
    decode never got the prompt's logprobs, so its recompute (of the prompt itself)
    asks for them, and the answer is `zpd run`'s."""
    c = InprocCluster(fault_plan=FaultRule("hang", count=1))      # the first write hangs
    try:
        sampling = ASK | {"top_logprobs_num": 2, "token_ids_logprob": [3]}
        rid = c.submit(PROMPT, 4, sampling=sampling)
        c.until(lambda: rid in c.answers and len(c.answers[rid].token_ids) == 1)
        assert c.admin("pause", mode="retract")["ok"]
        assert c.admin("continue")["ok"]
        got = c.run(rid)
        assert got.meta["retractions"] == 1 and got.status is None
        assert _inputs(got.meta) == _inputs(_offline(c, sampling, 4))
        c.check_pages()
    finally:
        c.close()


def test_the_client_response_has_them_where_zpd_run_does(cluster):
    """zpd.Client's assembled response lifts them out of the final meta, so it has
    the keys `zpd run`'s response has, with its values."""
    sampling = ASK | {"logprob_start_len": 35, "top_logprobs_num": 1}
    got = cluster.run(cluster.submit(PROMPT, 2, sampling=sampling))
    done = assemble([{"rid": "r", "token_ids": got.token_ids, "weight_versions": got.weight_versions,
                      "finish_reason": got.finish, "meta": got.meta, "text": None, "finished": True}])
    ref = _offline(cluster, sampling, 2)
    assert _inputs(done) == _inputs(ref) and len(done["input_token_logprobs"]) == 5
    assert not _inputs(done["meta"])


@pytest.mark.parametrize("bad", [{"logprob_start_len": 40}, {"token_ids_logprob": [10 ** 6]}])
def test_a_recompute_asking_what_cannot_be_computed_is_refused_alone(cluster, monkeypatch, bad):
    """A (forged) recompute whose prompt-logprob ask its prefix cannot serve is a 400
    to its decode, never a prefill step that fails its batch-mates."""
    sent = []
    monkeypatch.setattr(cluster.prefill, "send", lambda to, msg: sent.append(msg))
    sampling = SamplingParams.from_dict({"max_new_tokens": 4} | ASK | bad)
    cluster.prefill.scheduler.on_recompute(b"decode", p.Recompute("x", 77, 1, PROMPT, sampling))
    (failed,) = [m for m in sent if isinstance(m, p.KvFailed)]
    assert (failed.room, failed.epoch, failed.status) == (77, 1, 400)
    monkeypatch.undo()
    cluster.serves_again()
    cluster.check_pages()


def _sglang_meta(c: InprocCluster, body: dict, max_new: int) -> list[dict]:
    """`body` parsed as /generate, each item run through the cluster, answered in
    SGLang's shape (its meta_info)."""
    parsed = parse_generate(body)
    metas = []
    for item in parsed.items:
        got = c.run(c.submit(item.input_ids, max_new, sampling=item.sampling))
        out = Output(0, item, tiny_tokenizer())
        ids = [list(zip(item.token_ids_logprob, row)) for row in got.ids_logprobs or ()]
        out.add(chunk("r", got.token_ids, got.finish, got.meta, logprobs=got.logprobs,
                      top_logprobs=got.top_logprobs, token_ids_logprobs=ids))
        metas.append(native_answer(out)["meta_info"])
    return metas


def test_logprobs_without_a_start_have_sglangs_prompt_keys(cluster):
    """return_logprob and no logprob_start_len (SGLang's -1): SGLang starts at the last
    prompt position and nulls the first it reports, so input_token_logprobs is that
    token alone, logprob null; sglang.lang's select(unconditional_likelihood_normalized)
    sends exactly this body and reads the key (KeyError before)."""
    choices = [PROMPT[:5], PROMPT[5:12]]
    body = {"input_ids": choices, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True}
    for ids, meta in zip(choices, _sglang_meta(cluster, body, 0)):
        assert meta["input_token_logprobs"] == [[None, ids[-1], None]]
        assert meta["output_token_logprobs"] == []
        assert "input_top_logprobs" not in meta and "output_top_logprobs" not in meta
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2, "token_ids_logprob": [3, 4],
            "return_text_in_logprobs": True}
    (meta,) = _sglang_meta(cluster, body, 2)
    last = PROMPT[-1]
    assert meta["input_token_logprobs"] == [[None, last, tiny_tokenizer().token_text(last)]]
    assert meta["input_top_logprobs"] == [None] and meta["input_token_ids_logprobs"] == [None]
    assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == 2
    assert [len(row) for row in meta["output_token_ids_logprobs"]] == [2, 2]
    cluster.check_pages()
