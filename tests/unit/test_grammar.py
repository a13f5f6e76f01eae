"""Structured output in one process (tests/unit/inproc.py): regex, JSON schema and EBNF
outputs, greedy and sampled, through prefill and decode; the same tokens as `zpd run`
(whose sampling is seeded per position, so a sampled request draws the same there);
across a retraction and with a cached prefix; refusals that name the field."""
from __future__ import annotations

import json

import pytest
import torch

from engines.constraint import Constraint
from engines.grammar import Grammars
from engines.grammar_mask import Allowed, MaskMaker
from engines.loader import load_model
from engines.models.tiny import tiny_tokenizer
from engines.offline import OfflineEngine
from engines.request import Request, Unservable
from engines.sampler import Sampler
from engines.sampling_params import SamplingParams
from tests.unit.grammar_checks import EBNF, REGEX, SCHEMA, matches, valid_json
from tests.unit.inproc import InprocCluster
from transport import FaultRule
from zpd.worker.parts import recompute_sampling

TOK = tiny_tokenizer()
EOS = 257
PROMPT = TOK.encode("The answer: ")
LONG = [(7 * i + 3) % 250 for i in range(48)] + PROMPT     # 3 whole pages, then more
SEEDS = (None, 1, 2, 3, 4)                                  # None: greedy


def sampling(kind: str, seed: int | None, max_new: int = 80) -> dict:
    text = json.dumps(SCHEMA) if kind == "json_schema" else {"regex": REGEX, "ebnf": EBNF}[kind]
    return {kind: text, "max_new_tokens": max_new, "ignore_eos": False} | \
        ({"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed})


def follows(kind: str, text: str) -> bool:
    if kind == "json_schema":
        return valid_json(text)
    return matches({"regex": REGEX, "ebnf": r"yes|no|maybe [0-9]"}[kind], text)


@pytest.fixture(scope="module")
def engine() -> OfflineEngine:
    return OfflineEngine(load_model("tiny", dtype="float64"), kv_cache_mb=1)


def offline(engine: OfflineEngine, prompt: list[int], asks: list[dict]) -> list[list[int]]:
    """`zpd run`'s tokens for each of `asks` (one batch)."""
    reqs = [Request(f"ref{i}", prompt, SamplingParams.from_dict(a)) for i, a in enumerate(asks)]
    return [out["output_ids"] for out in engine.run(reqs)]


def check(kind: str, got: list, want: list[list[int]]) -> None:
    """Each answer ends with the grammar, follows it, and has `zpd run`'s tokens."""
    for answer, tokens in zip(got, want, strict=True):
        text = TOK.decode(answer.token_ids)
        assert answer.finish == {"type": "stop", "matched": EOS}, (answer.finish, text)
        assert follows(kind, text), (kind, text)
        assert answer.token_ids == tokens, text


@pytest.mark.parametrize("kind", ["regex", "json_schema", "ebnf"])
def test_every_greedy_and_sampled_output_follows_its_grammar(cluster, engine, kind):
    asks = [sampling(kind, s) for s in SEEDS]
    rids = [cluster.submit(PROMPT, sampling=a) for a in asks]
    check(kind, [cluster.run(rid, 3000) for rid in rids], offline(engine, PROMPT, asks))
    cluster.check_pages()


def test_a_retraction_keeps_the_grammar(cluster, engine):
    """Retracted mid-way (the decode's matcher has followed some tokens), recomputed
    after continue: the same tokens as without a retraction, each output still valid."""
    asks = [sampling("json_schema", s) for s in (None, 5, 6)]
    rids = [cluster.submit(PROMPT, sampling=a) for a in asks]
    cluster.until(lambda: all(len(cluster.answers[r].token_ids) >= 3 if r in cluster.answers
                              else False for r in rids), 3000)
    assert cluster.admin("pause", mode="retract")["ok"]
    assert cluster.admin("continue")["ok"]
    got = [cluster.run(rid, 3000) for rid in rids]
    assert [g.meta["retractions"] for g in got] == [1, 1, 1]
    check("json_schema", got, offline(engine, PROMPT, asks))
    cluster.check_pages()


@pytest.mark.parametrize("stream", [True, False], ids=["early_token", "whole"])
def test_a_retraction_before_the_kv(engine, stream):
    """Caught while its first write hangs. Streamed: the prefill sent the first token
    ahead and continue hands it to the decode, whose matcher replays it. Whole: the
    decode has no token, so its recompute carries the grammar and samples the first."""
    c = InprocCluster(fault_plan=FaultRule("hang", count=1))      # the first write hangs
    try:
        ask = sampling("json_schema", 8)
        rid = c.submit(PROMPT, stream=stream, sampling=ask)
        writing = lambda: [j for j in c.prefill.scheduler.jobs.values()    # noqa: E731
                           if j.phase.name == "WRITING"]
        c.until(lambda: writing() and (not stream or len(c.answers[rid].token_ids) == 1))
        assert c.admin("pause", mode="retract")["ok"]
        assert c.admin("continue")["ok"]
        got = c.run(rid, 3000)
        assert got.meta["retractions"] == 1
        check("json_schema", [got], offline(engine, PROMPT, [ask]))
        c.check_pages()
    finally:
        c.close()


def test_a_cached_prefix_changes_nothing(cluster, engine):
    warm = cluster.run(cluster.submit(LONG, 2), 3000)         # its prefix is cached now
    asks = [sampling("regex", s) for s in (None, 6, 7)]
    got = [cluster.run(rid, 3000) for rid in [cluster.submit(LONG, sampling=a) for a in asks]]
    assert warm.meta["cached_tokens"] == 0 and [g.meta["cached_tokens"] for g in got] == [48] * 3
    check("regex", got, offline(engine, LONG, asks))
    cluster.check_pages()


def test_ignore_eos_and_min_new_tokens_still_end_with_the_grammar(cluster):
    params = sampling("ebnf", None) | {"ignore_eos": True, "min_new_tokens": 20}
    got = cluster.run(cluster.submit(PROMPT, sampling=params), 3000)
    assert got.finish == {"type": "stop", "matched": EOS}
    assert follows("ebnf", TOK.decode(got.token_ids))


@pytest.mark.parametrize("field, text, words", [
    ("regex", "(((", "unclosed group"),
    ("json_schema", "{not json", "is not JSON"),
    ("json_schema", '{"type": "bogus"}', "bogus"),
    ("ebnf", "root ::= missing", "missing"),
])
def test_a_grammar_that_cannot_compile_is_a_400_naming_the_field(cluster, field, text, words):
    got = cluster.run(cluster.submit(PROMPT, sampling={field: text}))
    assert got.status == 400 and f"'sampling_params.{field}' " in got.finish["message"], got.finish
    assert words in got.finish["message"]
    cluster.serves_again()


def test_two_grammars_at_once_are_refused_by_name():
    with pytest.raises(ValueError, match="only one of regex, json_schema and ebnf.*regex and ebnf"):
        SamplingParams(regex="a", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match="regex must be null or a non-empty string"):
        SamplingParams(regex="")


def test_the_wire_carries_the_constraint_and_a_recompute_after_tokens_drops_it():
    p = SamplingParams(json_schema='{"type": "integer"}', max_new_tokens=4)
    assert SamplingParams.from_dict(p.to_wire()) == p
    assert p.constraint.kind == "json_schema" and p.constraint.as_sampling() == {
        "json_schema": '{"type": "integer"}'}
    req = Request("r", [1, 2], p)
    assert recompute_sampling(req).constraint == p.constraint    # it samples the first token
    req.output.append(49)
    assert recompute_sampling(req).constraint is None            # the decode samples the rest


def test_a_rebuilt_matcher_replays_the_output_and_a_foreign_token_ends_it(engine):
    compute = engine.compute
    req = Request("r", PROMPT, SamplingParams(regex="12+3"))
    req.output += TOK.encode("122", add_special_tokens=False)
    assert compute.finished(req) is None and req.grammar.consumed == 3
    req.output.append(TOK.encode("x", add_special_tokens=False)[0])
    got = compute.finished(req)
    assert got["type"] == "abort" and got["status_code"] == 500 and "breaks its grammar" in got["message"]


def test_the_mask_allows_only_the_grammars_tokens_and_the_end_once_complete():
    grammars = Grammars(TOK, 258, (EOS,))
    masks = MaskMaker(258)
    m = grammars.matcher(SamplingParams(regex="ab?").constraint)
    allowed = masks([None, m], torch.device("cpu"))
    assert allowed.rows == [1] and allowed.mask[0].nonzero().flatten().tolist() == [ord("a")]
    m.follow([ord("a")])
    assert masks([m], torch.device("cpu")).mask[0].nonzero().flatten().tolist() == [ord("b"), EOS]
    m.follow([ord("a"), ord("b")])
    got = masks([m], torch.device("cpu"))
    assert got.mask[0].nonzero().flatten().tolist() == [EOS] and got.ended == {0}
    # the sampler draws it though min_new_tokens bans the end token for others
    logits = torch.zeros(2, 258)
    params = [SamplingParams(min_new_tokens=9, temperature=0)] * 2
    tokens = Sampler((EOS,))(logits, params, [0, 0], [2, 2], [[1], [1]], [[], []])
    assert tokens[0] != EOS
    out = Sampler((EOS,)).sample(logits, params, [0, 0], [2, 2], [[1], [1]], [[], []],
                                 Allowed([1], got.blocked, {1}))
    assert out.tokens[1] == EOS and out.tokens[0] != EOS


def test_offline_refuses_a_bad_grammar(engine):
    with pytest.raises(Unservable, match="'sampling_params.regex' does not compile"):
        engine.submit(Request("r", PROMPT, SamplingParams(regex="[")))


@pytest.mark.parametrize("schema, text, follows", [
    ("$$ANY$$", '[1, {"a": null}]', True),                  # SGLang's any JSON value
    ('{"type": "object"}', '{"a": 1, "b": [2, 3]}', True),  # as json.dumps writes it
    ('{"type": "object"}', '{"a":1}', False),               # no free whitespace by default
    ('{"type": "object", "x-guidance": {"whitespace_flexible": true, "item_separator": ",", '
     '"key_separator": ":"}}', '{\n  "a" :1}', True),        # unless the schema asks
])
def test_json_whitespace_is_json_dumps_unless_the_schema_asks(schema, text, follows):
    m = Grammars(TOK, 258, (EOS,)).matcher(SamplingParams(json_schema=schema).constraint)
    assert m.follow(TOK.encode(text, add_special_tokens=False)) is follows


def test_smollm2_spells_json_and_regex_with_its_own_vocabulary():
    """A real vocabulary (49,152 byte-level BPE tokens, from the GGUF file): multi-byte
    tokens cross the grammar's symbols (in one process: the model loads once; the
    decode's replay is the tiny model's tests')."""
    model = load_model("smollm2", dtype="float32")
    prompt = model.encode_chat([{"role": "user", "content": "A JSON record, please."}])
    city = r"(Paris|Berlin|Rome) is [0-9]{1,4} km away\."       # bounded: it ends
    asks = [sampling("json_schema", s, 60) for s in (None, 1)] + \
        [sampling("regex", 3, 60) | {"regex": city}]
    outs = OfflineEngine(model, kv_cache_mb=16).run(
        [Request(f"s{i}", prompt, SamplingParams.from_dict(a)) for i, a in enumerate(asks)])
    for out, ask in zip(outs, asks):
        ok = valid_json(out["text"]) if "json_schema" in ask else matches(city, out["text"])
        assert out["finish_reason"] == {"type": "stop", "matched": 2} and ok, out
        assert any(len(model.tokenizer.decode([t])) > 1 for t in out["output_ids"]), out


def test_a_lark_grammar_embeds_a_schema_as_a_forced_tool_call_needs():
    """The shape a forced tool call takes (hermes-style): a fixed wrapper around JSON
    arguments that follow the tool's parameter schema, as one `ebnf` (Lark's %json)."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    lark = ('start: "<tool_call>\\n{\\"name\\": \\"weather\\", \\"arguments\\": " args "}\\n</tool_call>"\n'
            f"args: %json {json.dumps(schema)}")
    c = Constraint("ebnf", lark)
    assert SamplingParams.from_dict(c.as_sampling()).constraint == c
    for args, follows in (('{"city": "Paris"}', True), ('{"town": "Paris"}', False)):
        m = Grammars(TOK, 258, (EOS,)).matcher(c)
        text = f'<tool_call>\n{{"name": "weather", "arguments": {args}}}\n</tool_call>'
        assert m.follow(TOK.encode(text, add_special_tokens=False)) is follows
        assert m.ended is follows
