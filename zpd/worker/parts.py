"""A request's output as it crosses the wire: its tokens with their logprobs (only for a
request that asked), in a `TokenPart` to its client, and the first token's logprobs
from the prefill that sampled it to the decode (on `kv_done`) or, after a retraction,
through the router (the `early` token of `continue`, a `FirstToken`).
"""
from __future__ import annotations

import math
from dataclasses import replace

from engines.config import ModelConfig
from engines.prompt_logprobs import PromptLogprobs
from engines.routed import from_pieces
from engines.formats.tokenizer import Tokenizer
from engines.request import Request, answer_rows, response
from engines.sampling_params import SamplingParams
from zpd.wire.first_token import FirstToken
from zpd.wire.protocol import KvDone, Rows, TokenPart
from zpd.wire.rows import ROWS_META


def token_part(req: Request, start: int, meta: dict | None = None) -> TokenPart:
    """The request's output from index `start` on, with its finish once it has one."""
    p = req.params
    return TokenPart(req.rid, req.output[start:], req.weight_versions[start:], req.finish,
                     dict(meta or {}),
                     req.output_logprobs[start:] if p.wants_logprobs else None,
                     req.output_top_logprobs[start:] if p.top_logprobs_num else None,
                     req.output_ids_logprobs[start:] if p.output_ids_logprob else None, start)


def final_meta(req: Request, tokenizer: Tokenizer | None, cached_tokens: int,
               rows: Rows | None = None) -> dict:
    """A finished request's meta for its last TokenPart: counts, text, timings, the
    prompt's logprobs (input_*), which ride there because they are sent once, and how
    many routed expert ids its `rows` (sent just ahead) carry."""
    final = response(req, tokenizer, routed=False)
    return final["meta"] | {"text": final["text"], "cached_tokens": cached_tokens} \
        | {k: v for k, v in final.items() if k.startswith("input_")} \
        | ({ROWS_META: rows.values} if rows is not None else {})


def rows_of(req: Request) -> Rows | None:
    """The finished request's routed experts as they go to its client ahead of its
    final part (None: it asked none, or has none)."""
    rows = answer_rows(req)
    return None if rows is None else Rows.of(req.rid, *req.routed.wire(rows))


def first_logprob_fields(req: Request) -> dict:
    """`KvDone`'s logprob fields for the request's first token (none if it did not ask)."""
    if not req.params.wants_logprobs or not req.output:
        return {}
    out = {"logprob": req.output_logprobs[:1]}
    if req.params.top_logprobs_num:
        top = req.output_top_logprobs[0]
        out |= {"top_ids": [t for t, _ in top], "top_logprobs": [v for _, v in top]}
    if req.params.output_ids_logprob:
        out["ids_logprobs"] = list(req.output_ids_logprobs[0])
    return out


def prompt_logprob_fields(req: Request) -> dict:
    """`KvDone`'s prompt logprob fields (none unless its prefill computed them)."""
    got = req.prompt_logprobs
    if got is None:
        return {}
    out = {"prompt_logprobs": list(got.token_logprobs)}
    if got.top is not None:
        out |= {"prompt_top_ids": [t for row in got.top for t, _ in row],
                "prompt_top_logprobs": [v for row in got.top for _, v in row]}
    if got.token_ids is not None:
        out["prompt_ids_logprobs"] = [v for row in got.token_ids for v in row]
    return out


def recompute_sampling(req: Request) -> SamplingParams:
    """A recompute's sampling, asking only what the decode still needs: the prompt's
    logprobs only where it never got them (a retraction caught the KV before it came;
    the prefix is then the prompt itself), else the first answer stays; the sampled
    token's only where it has no first token yet (the recompute's is then its first),
    and its grammar only then too (the decode samples every later token, under the
    matcher that has followed its output)."""
    params = req.params
    if not asks_prompt_logprobs_again(req):
        params = replace(params, logprob_start_len=-1)
        if req.output:
            params = replace(params, return_logprob=False, top_logprobs_num=0, token_ids_logprob=())
    if req.output:      # the token it samples is not used: the decode follows its grammar
        params = replace(params, regex=None, json_schema=None, ebnf=None)
    return params


def asks_prompt_logprobs_again(req: Request) -> bool:
    """A recompute of `req` asks its prompt's logprobs (see recompute_sampling)."""
    return req.params.prompt_logprobs_from is not None and req.prompt_logprobs is None and \
        len(req.output) <= 1


def prompt_logprobs(req: Request, msg: KvDone) -> PromptLogprobs | None | str:
    """The prompt's logprobs as a `kv_done` gave them (None where the request asked
    for none), or what is wrong with them."""
    k, p = req.params.prompt_logprobs_from, req.params
    if k is None:
        return None
    first = max(k, 1)
    count = len(req.prompt) - first
    if msg.prompt_logprobs is None or len(msg.prompt_logprobs) != count:
        return f"no prompt logprobs for positions {first}..{len(req.prompt) - 1}"
    top = ids = None
    if p.top_logprobs_num:
        n = p.top_logprobs_num
        if msg.prompt_top_ids is None or len(msg.prompt_top_ids) != count * n:
            return "no prompt top logprobs"
        pairs = list(zip(msg.prompt_top_ids, msg.prompt_top_logprobs))
        top = [pairs[i * n:(i + 1) * n] for i in range(count)]
    if p.token_ids_logprob:
        n = len(p.token_ids_logprob)
        if msg.prompt_ids_logprobs is None or len(msg.prompt_ids_logprobs) != count * n:
            return "no prompt token_ids_logprob logprobs"
        ids = [msg.prompt_ids_logprobs[i * n:(i + 1) * n] for i in range(count)]
    return PromptLogprobs(first, list(msg.prompt_logprobs), top, ids)


def take_prompt_logprobs(req: Request, msg: KvDone) -> str | None:
    """Keep the prompt logprobs a `kv_done` gave; or say what is wrong with them."""
    got = prompt_logprobs(req, msg)
    if isinstance(got, str):
        return got
    req.prompt_logprobs = got
    return None


def take_routed(req: Request, msg: KvDone, cfg: ModelConfig) -> str | None:
    """Keep the routed experts a `kv_done` gave, one row per position its prefill
    computed (prompt + output[:-1]), replacing any before (a recompute's are under the
    weights of now); or say what is wrong with them. None where the request asked none."""
    want = req.params.routing
    if want is None:
        return None
    got = from_pieces(cfg, len(req.prompt) + max(0, len(req.output) - 1), msg.routed_experts,
                      msg.routed_expert_weights, want == "weights")
    if isinstance(got, str):
        return got
    req.routed = got
    return None


def first_logprobs(req: Request, msg: KvDone) -> tuple[float | None, list | None, list | None] | str:
    """The first token's (logprob, top alternatives, asked ids' logprobs) as a `kv_done`
    gave them, or what is missing of what the request asked for."""
    p = req.params
    if p.wants_logprobs and msg.logprob is None:
        return "no logprob for the first token"
    if p.top_logprobs_num and msg.top_ids is None:
        return "no top logprobs for the first token"
    asked = p.output_ids_logprob
    if asked and (msg.ids_logprobs is None or len(msg.ids_logprobs) != len(asked)):
        return f"no token_ids_logprob logprobs of {len(asked)} ids for the first token"
    top = list(zip(msg.top_ids, msg.top_logprobs)) if p.top_logprobs_num else None
    return (msg.logprob[0] if p.wants_logprobs else None), top, \
        (list(msg.ids_logprobs) if asked else None)


def cached_tokens(req: Request, msg: KvDone) -> int | str:
    """The prompt tokens a `kv_done`'s prefill took from its prefix cache, or why the
    figure cannot be right (it cannot exceed what was computed: the prompt, or after a
    retraction the prompt and the output but its last token)."""
    computed = len(req.prompt) + max(0, len(req.output) - 1)
    if not 0 <= msg.cached_tokens <= computed:
        return f"cached_tokens {msg.cached_tokens}, outside [0, {computed}]"
    return min(msg.cached_tokens, len(req.prompt))


def first_token_problem(req: Request, first: FirstToken, vocab: int) -> str | None:
    """Why `first` (the router's early token of `req`) cannot be taken, or None (a
    request whose token is refused is recomputed without it)."""
    if not 0 <= first.token < vocab:
        return f"early token {first.token} out of range"
    p = req.params
    if p.wants_logprobs and not _number(first.logprob):
        return "early token without its logprob"
    top = first.top
    if p.top_logprobs_num and not (isinstance(top, list) and all(
            isinstance(t, (list, tuple)) and len(t) == 2 and _id(t[0]) and _number(t[1])
            for t in top)):
        return "early token without its top logprobs"
    asked, ids = p.output_ids_logprob, first.ids_logprobs
    if asked and not (isinstance(ids, list) and len(ids) == len(asked) and all(map(_number, ids))):
        return "early token without its token_ids_logprob logprobs"
    return None


def take_first_token(req: Request, first: FirstToken) -> None:
    """Emit `first` as the request's first output token, with what it asked of logprobs."""
    p = req.params
    req.emit(first.token, first.version, first.logprob if p.wants_logprobs else None,
             [tuple(t) for t in first.top] if p.top_logprobs_num else None,
             first.ids_logprobs if p.output_ids_logprob else None)


def _id(value: object) -> bool:
    return type(value) is int


def _number(value: object) -> bool:
    return type(value) in (int, float) and not math.isnan(value)
