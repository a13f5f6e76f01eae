"""The leader's words to the other ranks of its group (engines/tp/group.py `tell` and
`hear`) as data, never as a pickle: a word is the name of one of the few things a rank
does (`OPS`) and its arguments, which are JSON values, tuples and the prompt-logprob
asks of a forward. Decoding builds nothing else, so a word that did not come from the
leader can at worst be refused, never run code."""
from __future__ import annotations

from typing import Any

import orjson

from engines.prompt_logprobs import PromptLogprobAsk

# What a rank other than 0 may be told to do (engines/tp/runner.py Follower's methods).
OPS = frozenset({"make_pool", "clear_pages", "forward", "release_kv", "resume_kv",
                 "release_weights", "resume_weights", "stage_weights", "swap_staged",
                 "drop_staged", "take_weights", "stop"})
# The words a rank answers (ok or failed: TpGroup.ask): those that can fail for want of
# memory or a file without putting the ranks out of step, and release_kv, so that
# "released" is said once every rank has let its pool go.
ASKED = frozenset({"make_pool", "release_kv", "resume_kv", "release_weights", "resume_weights",
                   "stage_weights"})
# The forwards a word may name (engines/runner.py ModelRunner's methods).
FORWARDS = frozenset({"prefill_with_logprobs", "decode"})


class WordError(ValueError):
    """A word that is not one the leader sends."""


def encode(op: str, args: tuple) -> bytes:
    if op not in OPS:
        raise WordError(f"no rank is told {op!r}")
    return orjson.dumps([op, [_plain(a) for a in args]])


def decode(data: bytes) -> tuple[str, tuple]:
    """(op, args) from `encode`'s bytes; a WordError for anything else."""
    try:
        word = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise WordError(f"not a word: {e}") from None
    if not (isinstance(word, list) and len(word) == 2 and isinstance(word[1], list)):
        raise WordError("a word is [op, [args]]")
    op, args = word
    if op not in OPS:
        raise WordError(f"unknown word {str(op)[:64]!r}")
    args = tuple(_typed(a) for a in args)
    if op == "forward" and (len(args) != 2 or args[0] not in FORWARDS or not isinstance(args[1], tuple)):
        raise WordError("a forward names one of the runner's forwards and its arguments")
    return op, args


def _plain(x: Any) -> Any:
    if isinstance(x, PromptLogprobAsk):
        return {"ask": [x.start, x.top_k, list(x.token_ids)]}
    if isinstance(x, tuple):
        return {"tuple": [_plain(v) for v in x]}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise WordError(f"a word cannot carry a {type(x).__name__}")


def _typed(x: Any) -> Any:
    if isinstance(x, list):
        return [_typed(v) for v in x]
    if not isinstance(x, dict):
        return x
    if set(x) == {"tuple"} and isinstance(x["tuple"], list):
        return tuple(_typed(v) for v in x["tuple"])
    if set(x) == {"ask"} and _is_ask(x["ask"]):
        start, top_k, ids = x["ask"]
        return PromptLogprobAsk(start, top_k, tuple(ids))
    raise WordError("a word's argument is a JSON value, a tuple or a logprob ask")


def _is_ask(v: Any) -> bool:
    return (isinstance(v, list) and len(v) == 3 and all(type(n) is int for n in v[:2])
            and isinstance(v[2], list) and all(type(n) is int for n in v[2]))
