"""token_ids_logprob at output positions (SGLang's output_token_ids_logprobs): the
sampler's equal log_softmax of the logits the sampled token's logprob comes from; the
cluster's equal `zpd run`'s, streamed or whole, greedy or sampled, the first token's
from the prefill ahead of the KV and across retractions; on the wire a malformed one is
refused; through the client and /generate in SGLang's [logprob, token_id, text] shape."""
from __future__ import annotations

import struct

import orjson
import pytest
import torch

from engines.loader import load_model
from engines.models.tiny import tiny_tokenizer
from engines.offline import OfflineEngine
from engines.request import Request, as_float32
from engines.sampler import Sampler, SamplingParams, token_logprobs
from tests.unit.http_fake import FakeBackend, call, front
from tests.unit.inproc import InprocCluster
from tests.unit.test_logprobs import reference_distributions
from transport import FaultRule
from zpd.client import asks_logprobs, assemble, chunk_of, sampling_record
from zpd.http.native import parse_generate
from zpd.http.native_format import native_delta
from zpd.http.output import Output
from zpd.wire import protocol as p
from zpd.worker import writes
from zpd.wire.first_token import FirstToken
from zpd.worker.parts import first_token_problem

PROMPT = [5, 17, 99, 3, 42, 7, 250, 1, 64, 31, 8, 200, 13, 77, 150, 9, 21]
IDS = [3, 50, 101, 7]
PENALTIES = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.25}
SAMPLINGS = {
    "greedy": {"return_logprob": True, "token_ids_logprob": IDS},
    "greedy_top": {"top_logprobs_num": 2, "token_ids_logprob": IDS, **PENALTIES},
    "seeded": {"temperature": 0.8, "seed": 5, "top_k": 20, "return_logprob": True,
               "token_ids_logprob": IDS, **PENALTIES},
}


def offline(model, sampling: dict, max_new: int) -> dict:
    """`zpd run`'s response (greedy, ignoring EOS unless `sampling` says otherwise)."""
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": max_new,
                                       "ignore_eos": True} | sampling)
    return OfflineEngine(model, kv_cache_mb=1).run([Request("ref", PROMPT, params)])[0]


def same_as_zpd_run(c: InprocCluster, rid: str, sampling: dict, max_new: int) -> None:
    """The cluster's answer has every token's ids' logprobs once, `zpd run`'s values."""
    got = c.run(rid)
    ref = offline(c.prefill.model, sampling, max_new)
    assert got.status is None and got.token_ids == ref["output_ids"]
    assert len(got.ids_logprobs) == len(got.token_ids) == max_new
    assert [[t for t, _ in row] for row in ref["output_token_ids_logprobs"]] == [IDS] * max_new
    assert got.ids_logprobs == [[v for _, v in row] for row in ref["output_token_ids_logprobs"]]
    assert got.logprobs == ref["output_token_logprobs"]


# --- the sampler ---------------------------------------------------------------------------


def test_the_samplers_are_log_softmax_of_the_same_logits():
    """Per asking row, the ids' logprobs (in the order asked, repeats kept) are
    log_softmax(logits / temperature) at those ids, temperature 1 when greedy; the sampled
    token's own logprob is the same number; rows not asking, or asking ids without
    logprobs, get None."""
    logits = torch.randn(4, 60, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ids = (0, 7, 59, 7)
    params = [SamplingParams(temperature=0, return_logprob=True, token_ids_logprob=ids),
              SamplingParams(temperature=0.7, seed=3, top_k=5, top_logprobs_num=2, token_ids_logprob=ids),
              SamplingParams(token_ids_logprob=ids), SamplingParams(return_logprob=True)]
    got = Sampler().sample(logits, params, [1, 2, 3, 4], [0] * 4, [[1]] * 4, [[]] * 4)
    for row, temp in ((0, 1.0), (1, 0.7)):
        ref = torch.log_softmax(logits[row] / temp, dim=-1)
        assert got.ids[row] == [ref[t].item() for t in ids]
        assert got.logprobs[row] == ref[got.tokens[row]].item()
    assert got.ids[2] is None and got.ids[3] is None and got.logprobs[2] is None
    assert token_logprobs(logits, params, got.tokens)[2] == got.ids


@pytest.fixture(scope="module")
def tiny64():
    return load_model("tiny", dtype="float64")


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.7, "seed": 3, "top_p": 0.5}],
                         ids=["greedy", "sampled"])
def test_the_engines_are_the_reference_distribution(tiny64, sampling):
    """`zpd run`'s equal an independent float64 reference of the distribution sampled
    from (penalties and temperature, before top-k/top-p/min-p): that of every other
    output logprob (engines.sampler.token_logprobs)."""
    params = SamplingParams(max_new_tokens=6, ignore_eos=True, return_logprob=True,
                            token_ids_logprob=tuple(IDS), **PENALTIES, **sampling)
    req = Request("ref", list(PROMPT), params)
    OfflineEngine(tiny64, kv_cache_mb=1).run([req])
    dists = reference_distributions(tiny64, req)
    assert len(req.output_ids_logprobs) == len(req.output) == len(dists)
    for row, dist in zip(req.output_ids_logprobs, dists):
        assert all(abs(v - dist[t]) < 1e-9 for v, t in zip(row, IDS))


def test_zpd_runs_response_has_them_only_when_asked(tiny64):
    asked = offline(tiny64, SAMPLINGS["greedy"], 3)
    rows = asked["output_token_ids_logprobs"]
    assert len(rows) == 3 and all([t for t, _ in row] == IDS for row in rows)
    assert all(v == as_float32([v])[0] for row in rows for _, v in row)
    assert "output_token_ids_logprobs" not in offline(tiny64, {"token_ids_logprob": IDS}, 3)
    assert "output_token_ids_logprobs" not in offline(tiny64, {"return_logprob": True}, 3)


# --- the cluster against `zpd run` -----------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize("sampling", SAMPLINGS.values(), ids=SAMPLINGS.keys())
def test_cluster_equals_zpd_run(cluster, sampling, stream):
    same_as_zpd_run(cluster, cluster.submit(PROMPT, 5, stream=stream, sampling=sampling), sampling, 5)
    cluster.check_pages()


def test_the_first_tokens_come_from_the_prefill_ahead_of_the_kv(cluster):
    firsts = []
    relay = cluster.router.on_first_tokens
    cluster.router.on_first_tokens = lambda w, msg: (firsts.append(msg), relay(w, msg))
    rid = cluster.submit(PROMPT, 4, sampling=SAMPLINGS["greedy"])
    same_as_zpd_run(cluster, rid, SAMPLINGS["greedy"], 4)
    (part,) = firsts[0].unpack()
    assert part.ids_logprobs == cluster.answers[rid].ids_logprobs[:1]


def test_a_retraction_loses_and_repeats_none(cluster):
    sampling = SAMPLINGS["seeded"]
    rid = cluster.submit(PROMPT, 16, sampling=sampling)
    cluster.until(lambda: rid in cluster.answers and len(cluster.answers[rid].token_ids) >= 4)
    assert cluster.admin("pause", mode="retract")["ok"]
    assert cluster.admin("continue")["ok"]
    same_as_zpd_run(cluster, rid, sampling, 16)
    assert cluster.answers[rid].meta["retractions"] == 1
    cluster.check_pages()


@pytest.mark.parametrize("stream", [True, False], ids=["early_token", "whole"])
def test_a_retraction_before_the_kv(stream):
    """Streamed: the prefill sent the first token ahead, continue hands it to the decode
    with its ids' logprobs. Whole: the decode has no token yet, and its recompute's first
    token comes with them (a recompute asked no logprobs at all before)."""
    c = InprocCluster(fault_plan=FaultRule("hang", count=1))      # the first write hangs
    try:
        sampling = SAMPLINGS["greedy_top"]
        rid = c.submit(PROMPT, 6, stream=stream, sampling=sampling)
        writing = lambda: [j for j in c.prefill.scheduler.jobs.values()    # noqa: E731
                           if j.phase.name == "WRITING"]
        c.until(lambda: writing() and (not stream or len(c.answers[rid].token_ids) == 1))
        assert c.admin("pause", mode="retract")["ok"]
        assert c.admin("continue")["ok"]
        if stream:
            held = c.decode.scheduler.by_rid[rid].req
            assert held.output_ids_logprobs == c.answers[rid].ids_logprobs
        same_as_zpd_run(c, rid, sampling, 6)
        assert c.answers[rid].meta["retractions"] == 1
        c.check_pages()
    finally:
        c.close()


def test_ids_out_of_the_vocabulary_are_400(cluster):
    got = cluster.run(cluster.submit(PROMPT, 3, sampling={"return_logprob": True,
                                                          "token_ids_logprob": [4, 10 ** 6]}))
    assert got.status == 400 and "token_ids_logprob: token id 1000000 out of range" in \
        got.finish["message"]
    cluster.check_pages()


def test_kv_done_without_the_first_tokens_fails_the_request(cluster, monkeypatch):
    real = writes.first_logprob_fields
    monkeypatch.setattr("zpd.worker.writes.first_logprob_fields",
                        lambda req: real(req) | ({"ids_logprobs": [-1.0]} if real(req) else {}))
    got = cluster.run(cluster.submit(PROMPT, 3, stream=False, sampling=SAMPLINGS["greedy"]))
    assert got.status == 500 and "no token_ids_logprob logprobs of 4 ids" in got.finish["message"]
    cluster.pump()
    cluster.check_pages()
    cluster.serves_again()


# --- the wire ----------------------------------------------------------------------------------


def test_tokens_carry_them_as_one_float32_blob():
    parts = [p.TokenPart("a", [1, 2], ["v", "v"], logprobs=[-0.5, -0.25], ids_logprobs=[[-1.0, -2.0], [-3.0, -4.0]]),
             p.TokenPart("b", [3], ["v"]),
             p.TokenPart("c", [4], ["v"], {"type": "length"}, {}, [-2.0], [[(4, -2.0)]], [[-0.5]]),
             p.TokenPart("d", [5], ["v"], logprobs=[-1.5])]
    got = p.decode(p.encode(p.Tokens.pack(parts)))
    assert got.ids_counts == [2, 0, 1, 0] and got.ids_logprobs == [-1.0, -2.0, -3.0, -4.0, -0.5]
    assert got.unpack() == parts
    assert parts[0].skip(1).ids_logprobs == [[-3.0, -4.0]]
    assert parts[0].then(parts[0]).ids_logprobs == parts[0].ids_logprobs * 2
    assert FirstToken.of(parts[0]).to_wire() == [1, "v", -0.5, None, [-1.0, -2.0]]
    plain = p.encode(p.Tokens.pack(parts[1:2] + parts[3:]))
    assert "ids_counts" not in orjson.loads(plain[0]) and len(plain) == 5


GOOD = dict(rids=["a", "b"], counts=[2, 1], token_ids=[1, 2, 3], weight_versions=["v"] * 3,
            logprob_mode=[1, 1], logprobs=[-1.0, -2.0, -3.0], ids_counts=[2, 1],
            ids_logprobs=[-1.0, -2.0, -3.0, -4.0, -5.0])


@pytest.mark.parametrize("bad", [
    {"ids_logprobs": [-1.0] * 4},                          # too few for the counts
    {"ids_logprobs": [-1.0] * 6},                          # too many
    {"ids_counts": [2]},                                   # not one per rid
    {"ids_counts": [-1, 7]},
    {"ids_counts": None},                                  # values without counts
    {"ids_logprobs": None},                                # counts without values
    {"logprob_mode": [0, 1], "logprobs": [-3.0]},          # ids without logprobs
    {"logprob_mode": None, "logprobs": None},
], ids=["few", "many", "per_rid", "negative", "no_counts", "no_values", "mode_0", "no_mode"])
def test_a_malformed_tokens_message_is_refused(bad):
    """Forged on the wire (the header rewritten, past the sender's own checks): the
    receiver's decode refuses it, as any malformed field."""
    good = p.encode(p.Tokens(**GOOD))
    assert p.decode(good).unpack()[0].ids_logprobs == [[-1.0, -2.0], [-3.0, -4.0]]
    header, blobs = orjson.loads(good[0]), list(good[1:])
    for key, value in bad.items():
        if value is None:
            header.pop(key, None)
        else:
            header[key] = len(blobs)
            code = "i" if type(value[0]) is int else "f"
            blobs.append(struct.pack(f"<{len(value)}{code}", *value))
    with pytest.raises(p.ProtocolError):
        p.decode([orjson.dumps(header), *blobs])


def test_a_sender_refuses_rows_of_different_lengths_and_kv_done_without_a_logprob():
    with pytest.raises(p.ProtocolError, match="different lengths"):
        p.Tokens.pack([p.TokenPart("a", [1, 2], ["v", "v"], logprobs=[-1.0, -1.0],
                                   ids_logprobs=[[-1.0], [-1.0, -2.0]])])
    with pytest.raises(p.ProtocolError, match="ids_logprobs without a logprob"):
        p.KvDone(1, 0, 5, "v", ids_logprobs=[-1.0])
    msg = p.KvDone(1, 0, 5, "v", logprob=[-0.5], ids_logprobs=[-1.0, -2.0])
    assert p.decode(p.encode(msg)) == msg


@pytest.mark.parametrize("entry, named", [
    ([50, "v", -0.5], "without its token_ids_logprob"),
    ([50, "v", -0.5, None, [-1.0]], "without its token_ids_logprob"),
    ([50, "v", -0.5, None, [-1.0, "x", -1.0, -1.0]], "without its token_ids_logprob"),
    ([50, "v", -0.5, None, [-1.0] * 4, 9], "malformed"),
])
def test_a_malformed_early_entry_is_not_taken(entry, named):
    req = Request("r", PROMPT, SamplingParams.from_dict(SAMPLINGS["greedy"]))
    try:
        problem = first_token_problem(req, FirstToken.from_wire(entry), 256)
    except p.ProtocolError as e:
        problem = str(e)
    assert named in problem
    good = FirstToken.from_wire([50, "v", -0.5, None, [-1.0] * 4])
    assert first_token_problem(req, good, 256) is None
    assert good == FirstToken(50, "v", -0.5, None, [-1.0] * 4)


# --- the client and /generate ---------------------------------------------------------------------


def test_the_clients_chunks_pair_them_with_the_ids_asked():
    asked = asks_logprobs(sampling_record({"return_logprob": True, "token_ids_logprob": [3, 9]}))
    assert asks_logprobs(sampling_record({"token_ids_logprob": [3, 9]})).ids == ()      # no logprobs: none
    first = chunk_of(p.TokenPart("r", [4, 5], ["v", "v"], None, {}, [-0.5, -1.0], None,
                                 [[-1.0, -2.0], [-3.0, -4.0]]), asked)
    assert first["token_ids_logprobs"] == [[[3, -1.0], [9, -2.0]], [[3, -3.0], [9, -4.0]]]
    end = chunk_of(p.TokenPart.abort("r", 503, "gone"), asked)        # the router's, none
    assert end["token_ids_logprobs"] == []
    whole = assemble([first, end])
    assert whole["output_token_ids_logprobs"] == first["token_ids_logprobs"]
    assert "token_ids_logprobs" not in chunk_of(p.TokenPart("r", [4], ["v"]), asks_logprobs(sampling_record({})))


def cluster_backend(c: InprocCluster) -> FakeBackend:
    """The HTTP front's router client, answered by the in-process cluster: each token
    a chunk, as the router client makes them (zpd.client.chunk_of)."""
    def script(req, rid):
        got = c.run(c.submit(req.input_ids, req.sampling.to_wire()["max_new_tokens"], sampling=req.sampling))
        whole = p.TokenPart(rid, got.token_ids, got.weight_versions, got.finish, got.meta,
                            got.logprobs, got.top_logprobs, got.ids_logprobs)
        parts = [_head(whole.skip(i)) for i in range(len(got.token_ids) - 1)] + [whole.skip(len(got.token_ids) - 1)]
        return [chunk_of(part, asks_logprobs(sampling_record(req.sampling))) for part in parts]
    return FakeBackend(script)


def _head(part: p.TokenPart) -> p.TokenPart:
    """The part's first token alone, unfinished."""
    return p.TokenPart(part.rid, part.token_ids[:1], part.weight_versions[:1], None, {},
                       *(None if x is None else x[:1] for x in (part.logprobs, part.top_logprobs,
                                                                  part.ids_logprobs)))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_generate_answers_sglang_triples_with_their_text(cluster, stream):
    """/generate as SGLang takes it: output_token_ids_logprobs per position [logprob,
    token_id, text], text with return_text_in_logprobs as in every other logprob list."""
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            "return_logprob": True, "logprob_start_len": 15, "top_logprobs_num": 1,
            "token_ids_logprob": IDS, "return_text_in_logprobs": True, "stream": stream}
    status, got = call(front(cluster_backend(cluster)), "POST", "/generate", body)
    assert status == 200
    meta = (got[-2] if stream else got)["meta_info"]
    ref = offline(cluster.prefill.model, SAMPLINGS["greedy"] | {"logprob_start_len": 15,
                                                                 "top_logprobs_num": 1}, 3)
    tok = tiny_tokenizer()
    assert meta["output_token_ids_logprobs"] == [[[v, t, tok.token_text(t)] for t, v in row]
                                                 for row in ref["output_token_ids_logprobs"]]
    assert meta["input_token_ids_logprobs"] == [[[v, t, tok.token_text(t)] for t, v in row]
                                                for row in ref["input_token_ids_logprobs"]]
    for key in ("output_token_logprobs", "input_token_logprobs"):
        assert all(text == tok.token_text(t) for _, t, text in meta[key])
    assert all(text == tok.token_text(t) for row in meta["output_top_logprobs"] for _, t, text in row)
    assert all(len(row) == len(IDS) for row in meta["output_token_ids_logprobs"])


def test_generate_takes_them_per_prompt_and_without_text():
    parsed = parse_generate({"input_ids": [[1, 2], [3]], "return_logprob": True,
                             "token_ids_logprob": [[4], []]})
    assert [item.token_ids_logprob for item in parsed.items] == [(4,), ()]
    one = parse_generate({"input_ids": [1, 2], "return_logprob": True, "token_ids_logprob": [4, 5]})
    assert one.items[0].sampling.to_wire()["token_ids_logprob"] == [4, 5]
    assert "token_ids_logprob" not in parse_generate(
        {"input_ids": [1], "token_ids_logprob": [4]}).items[0].sampling.to_wire()     # no logprobs: none
    backend = FakeBackend(lambda req, rid: [chunk_of(
        p.TokenPart(rid, [72], ["v"], {"type": "length"}, {}, [-0.5], None, [[-1.5]]),
        asks_logprobs(sampling_record(req.sampling)))])
    status, got = call(front(backend), "POST", "/generate",
                       {"input_ids": [1], "return_logprob": True, "token_ids_logprob": [9]})
    assert status == 200 and got["meta_info"]["output_token_ids_logprobs"] == [[[-1.5, 9, None]]]


def test_incremental_events_carry_only_the_new_positions():
    """--incremental-streaming-output: each event has the ids' triples of its new tokens."""
    (item,) = parse_generate({"input_ids": [1], "return_logprob": True,
                              "token_ids_logprob": [9, 72]}).items
    out = Output(0, item, tiny_tokenizer())
    asked = asks_logprobs(sampling_record(item.sampling))
    rows = []
    for part in (p.TokenPart("r", [72, 105], ["v", "v"], None, {}, [-0.5, -1.0], None,
                             [[-2.0, -0.5], [-3.0, -4.0]]),
                 p.TokenPart("r", [33], ["v"], {"type": "length"}, {}, [-0.25], None, [[-5.0, -6.0]])):
        out.add(chunk_of(part, asked))
        rows.append(native_delta(out, True)["meta_info"]["output_token_ids_logprobs"])
    assert rows == [[[[-2.0, 9, "\t"], [-0.5, 72, "H"]], [[-3.0, 9, "\t"], [-4.0, 72, "H"]]],
                    [[[-5.0, 9, "\t"], [-6.0, 72, "H"]]]]
