"""SGLang's native `POST /generate`: field names as SGLang's, so an RL framework that
speaks to SGLang (slime, AReaL, verl's HTTP adapter) speaks to zpd by changing a URL.

A prompt is `text` or `input_ids`; a list of them is a batch, answered with a list.
`sampling_params.n` > 1 runs n generations of each prompt (copy-major, as SGLang
orders them) and answers a list even for one prompt. Which fields are taken, ignored
or refused: sglang_fields.py. `stream: true` answers server-sent events, each
carrying the text, output_ids and logprobs so far (SGLang's default), or with
--incremental-streaming-output only what is new since the last event (SGLang's
flag), ending with `data: [DONE]`. As each cumulative event repeats everything so
far, a stream's cumulative events are spaced so that it writes about
--cumulative-bytes-per-token bytes per token, not O(n^2) bytes. A request that
ends in an abort or failure still answers 200 with finish_reason {"type": "abort",
"status_code", "message", "err_type"}; one the workers refuse as malformed (400,
nothing generated) answers HTTP 400.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from aiohttp import web

from engines.constraint import GRAMMAR_KINDS
from engines.sampling_params import INT32_MAX, SamplingParams
from zpd.config import HttpConfig
from zpd.http.front import FRONT, Front, json_answer, read_body
from zpd.http.bodies import Generate, Sampling, decode
from zpd.http.structured import grammar_sampling
from zpd.http.output import Output
from zpd.http.records import (MAX_TOP_LOGPROBS, BadRequest, GenRequest, boolean,
                              check_call_logprobs, check_count,
                              check_prompts, checked_sampling, id_list, integer, item_rids,
                              logprob_sampling, seeded_copies, text_field, token_ids)
from zpd.http.sglang_fields import GENERATE, SAMPLING, screen
from zpd.http.native_format import CumulativeEvents, NativeEvents, native_answer
from zpd.http.streams import Stalled, pump, run_all

routes = web.RouteTableDef()

# the engine's fields among sampling_params', in their order
ENGINE_SAMPLING = tuple(name for name in Sampling.__struct_fields__
                        if name in {f.name for f in fields(SamplingParams)})
DEFAULTS = HttpConfig()
# what a request asks of its routed experts (engine fields of the same names)
ROUTED = ("return_routed_experts", "return_routed_expert_weights")


@dataclass(frozen=True)
class NativeGenerate:
    """A /generate body, checked: one GenRequest per generation (copy-major)."""
    items: list[GenRequest]
    batch: bool                      # answered with a list
    stream: bool
    unknown: tuple[str, ...] = ()    # names neither SGLang nor OpenAI has (warned, dropped)


@dataclass(frozen=True)
class Options:
    """One prompt's sampling_params: what goes to the engine, and what the front does."""
    engine: dict
    trim: bool = True                # cut the text before a matched stop (not no_stop_trim)
    skip_special: bool = True
    n: int = 1
    unknown: tuple[str, ...] = ()


def parse_generate(body: dict, cfg: HttpConfig = DEFAULTS) -> NativeGenerate:
    unknown = screen(body, GENERATE)
    gen = decode(body, Generate)
    prompts, batch = _prompts(gen)
    check_count(len(prompts), 1, cfg.max_batch_requests)
    check_prompts(prompts, cfg.prompt_limits, next(iter(prompts[0])))
    raws = _per_prompt(body.get("sampling_params"), len(prompts))
    models = _per_prompt(gen.sampling_params, len(prompts))
    samplings = [engine_options(raw or {}, model) for raw, model in zip(raws, models)]
    n = _parallel(samplings)
    check_count(len(prompts), n, cfg.max_batch_requests)
    count = len(prompts)
    wants = _per_item("return_logprob", gen.return_logprob, count, n, boolean, False)
    tops = _per_item("top_logprobs_num", gen.top_logprobs_num, count, n,
                     integer(0, MAX_TOP_LOGPROBS), 0)
    starts = _prompt_logprob_starts(gen, prompts, wants, n)
    ids = _token_ids_logprob(gen.token_ids_logprob, count, n)
    named = _per_item("return_text_in_logprobs", gen.return_text_in_logprobs, count, n,
                      boolean, False)
    rids = item_rids(gen.rid, count, n, batch)
    routed = [{k: True for k, v in zip(ROUTED, asked) if v} for asked in zip(*(
        _per_item(k, getattr(gen, k), count, n, boolean, False) for k in ROUTED))]
    copies = [seeded_copies(checked_sampling(
        sp.engine | logprob_sampling(wants[p], tops[p], starts[p], ids[p]) | routed[p]), n)
              for p, sp in enumerate(samplings)]
    items = []
    for j in range(n):
        for p, prompt in enumerate(prompts):
            items.append(GenRequest(copies[p][j], rid=rids[len(items)], stream=gen.stream,
                                    trim_stop=samplings[p].trim,
                                    skip_special=samplings[p].skip_special,
                                    text_in_logprobs=named[p], **prompt))
    names = tuple(unknown) + tuple(f"sampling_params.{u}" for sp in samplings for u in sp.unknown)
    return NativeGenerate(items, batch or n > 1, gen.stream, tuple(dict.fromkeys(names)))


def _parallel(samplings: list[Options]) -> int:
    """The n every prompt's sampling_params agree on (SGLang requires one)."""
    ns = {s.n for s in samplings}
    if len(ns) != 1:
        raise BadRequest("'sampling_params.n' must be the same for every prompt")
    return ns.pop()


def _per_item(name: str, value: Any, count: int, n: int, check: Any, default: Any) -> list:
    """One value for every prompt: a single value, or a list of one per prompt (a single
    prompt is a batch of one: SGLang's item 0 of it). With n > 1 a list is refused, as
    SGLang refuses it ("Cannot use list ... with parallel_sample_num > 1")."""
    if type(value) is not list:
        return [default if value is None else check(name, value)] * count
    if n > 1:
        raise BadRequest(f"{name!r} cannot be a list with 'sampling_params.n' {n} > 1: "
                         "give one value for every generation")
    if len(value) != count:
        raise BadRequest(f"{name!r} has {len(value)} entries for {_prompts_word(count)}")
    return [default if v is None else check(f"{name}[{i}]", v) for i, v in enumerate(value)]


def _prompts_word(count: int) -> str:
    return f"{count} prompt" + ("s" if count != 1 else "")


def _token_ids_logprob(value: list | None, count: int, n: int) -> list[list[int]]:
    """token_ids_logprob: a list of ids is one for every prompt; a list of lists, one
    per prompt (SGLang's rule)."""
    if _nested(value):
        return _per_item("token_ids_logprob", value, count, n, id_list, [])
    return [[] if value is None else id_list("token_ids_logprob", value)] * count


def _prompt_logprob_starts(gen: Generate, prompts: list[dict], wants: list[bool],
                           n: int) -> list[int]:
    """Each prompt's logprob_start_len (-1: no prompt logprobs); one at or past the end
    of a prompt given as ids is refused here (a text's, by the worker once tokenized)."""
    starts = _per_item("logprob_start_len", gen.logprob_start_len, len(wants), n,
                       integer(-1, INT32_MAX), -1)
    for i, (prompt, want, start) in enumerate(zip(prompts, wants, starts)):
        ids = prompt.get("input_ids")
        if want and ids is not None and start >= len(ids):
            raise BadRequest(f"'logprob_start_len' {start} must be less than the prompt's "
                             f"length ({len(ids)} tokens)" + (f" (prompt {i})" if len(prompts) > 1 else ""))
    return starts


def _nested(value: list | None) -> bool:
    """token_ids_logprob is a list per prompt (a list of lists), not one for all."""
    return bool(value) and all(type(v) is list for v in value)


def _prompts(gen: Generate) -> tuple[list[dict], bool]:
    """[{"text": ...} or {"input_ids": ...}, ...] and whether the body was a batch."""
    if (gen.text is None) == (gen.input_ids is None):
        raise BadRequest("give exactly one of 'text' or 'input_ids'")
    if gen.text is not None:
        if isinstance(gen.text, list):
            _non_empty(gen.text, "text")
            return [{"text": text_field(f"text[{i}]", t)} for i, t in enumerate(gen.text)], True
        return [{"text": text_field("text", gen.text)}], False
    value = gen.input_ids
    if value and all(isinstance(v, list) for v in value):
        return [{"input_ids": token_ids(f"input_ids[{i}]", ids)} for i, ids in enumerate(value)], True
    return [{"input_ids": token_ids("input_ids", value)}], False


def _per_prompt(value: Any, count: int) -> list[Any]:
    """One sampling_params for every prompt: one for all, or a list of one per prompt
    (a single prompt is a batch of one, as SGLang reads it); each copy of a prompt
    (n > 1) takes that prompt's."""
    if value is None:
        return [None] * count
    if isinstance(value, list):
        if len(value) != count:
            raise BadRequest(f"'sampling_params' has {len(value)} entries for {_prompts_word(count)}")
        return value
    return [value] * count


def engine_options(raw: dict, sampling: Sampling | None) -> Options:
    """SGLang's sampling_params (`raw`, decoded as `sampling`) -> the engine's sampling
    dict (the fields given) and the front's options; names neither SGLang nor zpd has
    are dropped (and named)."""
    unknown = tuple(screen(raw, SAMPLING, "sampling_params."))
    sampling = sampling or Sampling()
    n = integer(1, INT32_MAX)("n", sampling.n)        # prompts x n is capped by the caller
    engine = {k: v for k in ENGINE_SAMPLING if (v := getattr(sampling, k)) is not None
              and k not in GRAMMAR_KINDS}
    engine |= grammar_sampling({k: getattr(sampling, k) for k in GRAMMAR_KINDS}, "sampling_params.")
    if sampling.sampling_seed is not None:
        engine.setdefault("seed", sampling.sampling_seed)
    if engine.get("min_new_tokens") == 0:
        del engine["min_new_tokens"]    # the default: engines that predate it take the rest
    return Options(engine, not sampling.no_stop_trim, sampling.skip_special_tokens, n, unknown)


def _non_empty(value: list, name: str) -> None:
    if not value:
        raise BadRequest(f"{name!r} must not be an empty list")


def engine_sampling(raw: dict) -> Options:
    """engine_options of one sampling_params object as a body carries it."""
    return engine_options(raw, decode(raw, Sampling, "sampling_params."))


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    front = request.app[FRONT]
    req = parse_generate(await read_body(request), front.config)
    check_call_logprobs(req.items, front.config.max_call_logprobs)
    front.unknown_fields.note(req.unknown, "/generate")
    if any(item.text is not None for item in req.items):
        front.needs_text("a text prompt")
    if req.stream:
        return await _stream(request, front, req)
    outs = await run_all(front.backend, req.items, front.tokenizer, front.config.max_answer_bytes)
    refused = next((e for e in map(Output.refusal, outs) if e is not None), None)
    if refused is not None:
        raise refused
    def answer() -> object:
        answers = [native_answer(o) for o in outs]
        return answers if req.batch else answers[0]
    return await json_answer(answer)


async def _stream(request: web.Request, front: Front, req: NativeGenerate) -> web.StreamResponse:
    cfg = front.config
    events = front.event_stream(request)
    cumulative = None if cfg.incremental_streaming_output else \
        CumulativeEvents(cfg.cumulative_bytes_per_token)
    render = NativeEvents(req.batch, cumulative).render
    try:
        await pump(front.backend, req.items, front.tokenizer, events, render)
        return await events.close()
    except Stalled:
        return events.abandon([item.rid or "" for item in req.items])
