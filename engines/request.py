"""A request's record: counts are the truth, everything else is derived."""
from __future__ import annotations

import random
import time
from array import array
from dataclasses import dataclass, field

from engines.config import ModelConfig
from engines.prompt_logprobs import PromptLogprobAsk, PromptLogprobs
from engines.routed import RoutedExperts, routed_refusal
from engines.sampler import SamplingParams
from engines.formats.tokenizer import Tokenizer


# The most prompt logprob entries one request gets (positions x (1 + top_logprobs_num +
# len(token_ids_logprob))): the decode's final answer carries them in one message
# header, ~30 bytes each, which must stay well inside the wire's 16 MiB frame.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18


class Unservable(ValueError):
    """A request that can never be served as asked: the client's error, reported as
    status 400 (the serving layer's codes live in zpd/wire/status.py)."""
    status = 400


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: SamplingParams
    seed: int = field(default_factory=lambda: random.getrandbits(63))
    output: list[int] = field(default_factory=list)
    weight_versions: list[str] = field(default_factory=list)
    # One per output token when the request asks (params.wants_logprobs, and
    # top_logprobs_num > 0 for the second), else empty: see engines.sampler.token_logprobs.
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    output_ids_logprobs: list[list[float]] = field(default_factory=list)   # params.output_ids_logprob's
    # The prompt's, from the prefill of its first epoch (a recompute never replaces them)
    # when params.prompt_logprobs_from asks.
    prompt_logprobs: PromptLogprobs | None = None
    scored_version: str | None = None    # max_new_tokens 0: the weights that scored the prompt
    # Its routed experts so far when params.routing asks (engines/routed.py): a row per
    # position fed, prompt + output[:-1]; the last prefill's rows, then the decode's.
    routed: RoutedExperts | None = None
    # Its grammar's matcher (engines/grammar.py) when params.constraint asks: built by
    # Compute on first use, following the output from its first token on.
    grammar: object | None = None
    pages: list[int] = field(default_factory=list)
    finish: dict | None = None
    retractions: int = 0
    arrived: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    # Where the time went, in ms, reported in meta["timings"]: prefill_queue (generate
    # received -> forward starts), prefill_forward (the forward it was part of, with
    # sampling), kv_dest_wait (forward done -> decode's destination known), kv_transfer
    # (write submitted -> complete). Those of the last prefill after a recompute.
    timings: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.params.seed is not None:
            self.seed = self.params.seed

    @property
    def context_len(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def max_context(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.finish is not None

    @property
    def prompt_logprob_ask(self) -> PromptLogprobAsk | None:
        """What its first prefill computes of the prompt's logprobs (None: nothing)."""
        start, p = self.params.prompt_logprobs_from, self.params
        if start is None or self.output or self.prompt_logprobs is not None:
            return None
        return PromptLogprobAsk(start, p.top_logprobs_num, p.token_ids_logprob)

    @property
    def reusable_prefix(self) -> int | None:
        """Prompt tokens its prefill may take from a prefix cache: those before the first
        logit its prompt logprobs read (position max(k, 1) - 1); none when it asks for
        its routed experts (a cached prefix's routing is not kept: it is recomputed, so
        it is always there and of the weights of now); None: no bound."""
        if self.params.routing is not None:
            return 0
        ask = self.prompt_logprob_ask
        return None if ask is None else max(ask.start, 1) - 1

    def emit(self, token: int, version: str, logprob: float | None = None,
             top: list[tuple[int, float]] | None = None, ids: list[float] | None = None) -> None:
        """Append an output token; its `logprob`, `top` alternatives and asked `ids`'
        logprobs are kept when the request asks for them (NaN and none where a caller
        has nothing to give)."""
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()
        self.output.append(token)
        self.weight_versions.append(version)
        if self.params.wants_logprobs:
            self.output_logprobs.append(float("nan") if logprob is None else logprob)
        if self.params.top_logprobs_num:
            self.output_top_logprobs.append(list(top or []))
        if self.params.output_ids_logprob:
            self.output_ids_logprobs.append(list(ids or []))

    def abort(self, status: int, message: str) -> None:
        if self.finish is None:
            self.finish = {"type": "abort", "status_code": status, "message": message}


def validate(prompt: list[int], params: SamplingParams, cfg: ModelConfig, page_size: int,
             total_pages: int, routed_experts: bool = False) -> None:
    """Reject what can never be served, with the reason (status 400). `routed_experts`:
    this worker records routed experts (--enable-return-routed-experts)."""
    if not prompt:
        raise Unservable("empty prompt")
    # lengths first: a megabyte prompt's ids took the loop a second to scan
    if len(prompt) + params.max_new_tokens > cfg.max_position:
        raise Unservable(f"prompt ({len(prompt)} tokens) + max_new_tokens "
                         f"({params.max_new_tokens}) exceeds the context length {cfg.max_position}")
    bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < cfg.vocab_size]
    if bad:
        raise Unservable(f"token id {bad[0]!r} out of range [0, {cfg.vocab_size})")
    validate_prompt_logprobs(len(prompt), params, cfg)
    validate_routing(len(prompt) + params.max_new_tokens, params, cfg, routed_experts)
    pages = -(-(len(prompt) + params.max_new_tokens) // page_size)
    if pages > total_pages:
        raise Unservable(f"request needs {pages} KV pages; this worker has "
                         f"{total_pages} in all")


def prompt_logprob_entries(length: int, params: SamplingParams) -> int:
    """The prompt logprob entries a `length`-token prompt asks for: positions x (1 +
    top_logprobs_num + len(token_ids_logprob)); 0 when it asks none."""
    start = params.prompt_logprobs_from
    if start is None:
        return 0
    return max(0, length - max(start, 1)) * (1 + params.top_logprobs_num + len(params.token_ids_logprob))


def validate_prompt_logprobs(length: int, params: SamplingParams, cfg: ModelConfig) -> None:
    """A prompt logprob ask the prefill can compute for a `length`-token prompt."""
    if params.prompt_logprobs_from is not None and params.prompt_logprobs_from >= length:
        raise Unservable(f"logprob_start_len {params.prompt_logprobs_from} must be less than "
                         f"the prompt's length ({length} tokens)")
    bad = [t for t in params.token_ids_logprob if t >= cfg.vocab_size]
    if bad:
        raise Unservable(f"token_ids_logprob: token id {bad[0]} out of range [0, {cfg.vocab_size})")
    if params.prompt_logprobs_from is not None:
        each = 1 + params.top_logprobs_num + len(params.token_ids_logprob)
        entries = prompt_logprob_entries(length, params)
        if entries > MAX_PROMPT_LOGPROB_ENTRIES:
            raise Unservable(f"prompt logprobs of {length - max(params.prompt_logprobs_from, 1)} "
                             f"positions x {each} values each are more than "
                             f"{MAX_PROMPT_LOGPROB_ENTRIES} in one answer: raise "
                             "logprob_start_len or ask fewer top_logprobs_num/token_ids_logprob")


def validate_routing(max_context: int, params: SamplingParams, cfg: ModelConfig,
                     enabled: bool) -> None:
    """A routed experts ask this worker can answer (engines/routed.py)."""
    refusal = routed_refusal(cfg, enabled, params.routing, max_context)
    if refusal is not None:
        raise Unservable(refusal)


def validate_prefix(prefix: list[int], cfg: ModelConfig, capacity_tokens: int) -> None:
    """A recompute's prefix (prompt + output[:-1]) was valid once; check it still fits."""
    if not prefix or len(prefix) >= cfg.max_position or len(prefix) > capacity_tokens:
        raise Unservable(f"recompute of {len(prefix)} tokens does not fit")
    if any(not 0 <= t < cfg.vocab_size for t in prefix):
        raise Unservable("recompute has out-of-range token ids")


class StopChecker:
    """Decides whether a request is done after its latest token."""

    def __init__(self, eos_ids: tuple[int, ...], tokenizer: Tokenizer | None) -> None:
        self.eos_ids, self.tokenizer = set(eos_ids), tokenizer

    def __call__(self, req: Request) -> dict | None:
        p, token = req.params, req.output[-1]
        if len(req.output) < p.min_new_tokens:      # SGLang's: no stop of any kind before
            return None
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            return {"type": "stop", "matched": token}
        if p.stop and self.tokenizer is not None:
            longest = max(map(len, p.stop))
            # a stop string that appears now must end within the last few tokens
            tail = self.tokenizer.decode(req.output[-(longest + 4):])
            for s in p.stop:
                if s in tail:
                    return {"type": "stop", "matched": s}
        if len(req.output) >= p.max_new_tokens:
            return {"type": "length"}
        return None


def response(req: Request, tokenizer: Tokenizer | None, routed: bool = True) -> dict:
    """The finished request in the contract's shape (docs/design.md, "Python client");
    without its routed experts unless `routed` (a worker sends them apart: zpd/wire/rows.py)."""
    text = None
    if tokenizer is not None:
        text = tokenizer.decode(req.output)
        matched = (req.finish or {}).get("matched")
        if isinstance(matched, str) and matched in text:
            text = text[:text.index(matched)]
    return {"rid": req.rid, "output_ids": list(req.output), "text": text,
            "finish_reason": req.finish, "weight_versions": list(req.weight_versions),
            "meta": {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.output),
                     "retractions": req.retractions} | ({"timings": req.timings} if req.timings else {})
            | ({"weight_version": req.scored_version} if req.scored_version is not None else {})
            | (routed_fields(req) if routed else {})
            } | logprob_fields(req) | prompt_logprob_fields(req)


def routed_fields(req: Request) -> dict:
    """routed_experts (and routed_expert_weights) where the request asked and has a row
    for each position fed (`answer_rows`)."""
    rows = answer_rows(req)
    return {} if rows is None else req.routed.fields(rows)


def answer_rows(req: Request) -> int | None:
    """The rows of routed experts its answer has: one for each position fed, prompt +
    output[:-1], where the request asked and has them (None: an abort before its KV
    came has none). A scored prompt (max_new_tokens 0) has a row more, its last
    token's, which SGLang's (prompt + output - 1) rows leave out."""
    got, rows = req.routed, req.context_len - 1
    if got is None or not (got.rows == rows or (req.params.scores_only and got.rows == rows + 1)):
        return None
    return rows


def logprob_fields(req: Request) -> dict:
    """The response's logprob fields, only those the request asked for, as float32 (what
    the wire carries), so `zpd run` and the cluster answer the same numbers."""
    out = {}
    if req.params.wants_logprobs:
        out["output_token_logprobs"] = as_float32(req.output_logprobs)
    if req.params.top_logprobs_num:
        out["output_top_logprobs"] = [top_pairs(top) for top in req.output_top_logprobs]
    asked = req.params.output_ids_logprob
    if asked:          # per position [[token id, logprob], ...], as input_token_ids_logprobs
        out["output_token_ids_logprobs"] = [[list(pair) for pair in zip(asked, as_float32(row))]
                                            for row in req.output_ids_logprobs]
    return out


def prompt_logprob_fields(req: Request) -> dict:
    """The prompt's logprobs from position logprob_start_len k on, SGLang's positions:
    input_token_logprobs [[logprob, token id], ...] (position 0's logprob null), and
    where asked input_top_logprobs and input_token_ids_logprobs, per position
    [[token id, logprob], ...] (null at position 0), all float32. Without k (-1),
    SGLang's default: unasked_prompt_fields."""
    k, got = req.params.prompt_logprobs_from, req.prompt_logprobs
    if k is None:
        return unasked_prompt_fields(req)
    if got is None:
        return {}
    lead = got.first - k                      # 1 when k is 0: position 0 has none
    ids = req.prompt[k:]
    out = {"input_token_logprobs": [[v, t] for v, t in zip([None] * lead + as_float32(got.token_logprobs), ids)]}
    if got.top is not None:
        out["input_top_logprobs"] = [None] * lead + [top_pairs(top) for top in got.top]
    if got.token_ids is not None:
        asked = req.params.token_ids_logprob
        out["input_token_ids_logprobs"] = [None] * lead + [
            [list(pair) for pair in zip(asked, as_float32(row))] for row in got.token_ids]
    return out


def unasked_prompt_fields(req: Request) -> dict:
    """What SGLang answers for the prompt of a request with logprobs and no
    logprob_start_len (its -1): it starts at the last prompt position and nulls the
    first position it reports, so input_token_logprobs is [[null, last prompt id]]
    (input_top_logprobs and input_token_ids_logprobs [null] where asked). Clients
    (sglang.lang's select) read the key whenever they asked for logprobs."""
    p = req.params
    if not p.wants_logprobs or not req.prompt:
        return {}
    out = {"input_token_logprobs": [[None, req.prompt[-1]]]}
    if p.top_logprobs_num:
        out["input_top_logprobs"] = [None]
    if p.token_ids_logprob:
        out["input_token_ids_logprobs"] = [None]
    return out


def as_float32(values: list[float]) -> list[float]:
    """Each value rounded to the nearest float32."""
    return array("f", values).tolist()


def top_pairs(top: list[tuple[int, float]]) -> list[list]:
    """One token's alternatives as JSON-ready [token id, float32 logprob] pairs."""
    return [[t, v] for (t, _), v in zip(top, as_float32([v for _, v in top]))]
