"""What the HTTP front spends reading a request body, per body, side by side: a
slime-style /generate (512 token ids, logprobs, SGLang sampling_params) and a
/v1/chat/completions (system + user message).

    python bench/bench_http_bodies.py [--rounds 5] [--calls 2000]

Sides, in microseconds per body (the best of --rounds, each --calls calls):
  orjson.loads   the JSON alone: the floor every side pays
  msgspec        zpd's models (zpd/http/bodies.py) decoded from the loaded body
  pydantic       the same models as pydantic 2 models (strict), validated the same way
  zpd parse      what a route runs: loads, the msgspec model, bounds and GenRequest records

msgspec and pydantic validate the same declared types, so their difference is the
library's. On a shared 2-core machine (loads included): msgspec 10.8 / 2.2 us,
pydantic 18.8 / 2.7 us; zpd parse 65.4 / 29.9 us, as the hand-written field-by-field
path it replaced (63.6 / 29.6 us): what remains is the bounds (each token id's range,
SamplingParams' checks, the chat template's message check), not the decoding.
In-process, no server.
"""
from __future__ import annotations

import argparse
import sys
import time
import typing
from pathlib import Path
from typing import Any, Callable

import msgspec
import orjson
import pydantic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # the repository

from zpd.http import bodies  # noqa: E402
from zpd.http.native import parse_generate  # noqa: E402
from zpd.http.openai_protocol import parse_chat  # noqa: E402

GENERATE = orjson.dumps({"input_ids": list(range(1000, 1512)), "return_logprob": True,
                         "sampling_params": {
                             "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 256,
                             "stop": None, "stop_token_ids": None, "skip_special_tokens": False,
                             "no_stop_trim": True, "spaces_between_special_tokens": False}})
CHAT = orjson.dumps({"model": "m", "max_tokens": 64, "temperature": 0.7, "top_p": 0.9,
                     "stream": False, "messages": [
                         {"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Name three primes above one hundred. " * 4}]})
CASES = (("/generate", GENERATE, bodies.Generate, parse_generate),
         ("/v1/chat/completions", CHAT, bodies.Chat, parse_chat))


def as_pydantic(struct: type, made: dict[type, type]) -> type:
    """`struct` (a msgspec model) as a strict pydantic model with the same fields."""
    if struct not in made:
        hints = typing.get_type_hints(struct)
        fields = {f.name: (_swap(hints[f.name], made), f.default) for f in msgspec.structs.fields(struct)}
        made[struct] = pydantic.create_model(f"P{struct.__name__}", __config__=pydantic.ConfigDict(strict=True),
                                             **fields)
    return made[struct]


def _swap(hint: Any, made: dict[type, type]) -> Any:
    """`hint` with every msgspec model in it replaced by its pydantic twin."""
    if isinstance(hint, type) and issubclass(hint, msgspec.Struct):
        return as_pydantic(hint, made)
    args = typing.get_args(hint)
    if not args:
        return hint
    swapped = tuple(_swap(a, made) for a in args)
    origin = typing.get_origin(hint)
    return typing.Union[swapped] if origin is typing.Union else origin[swapped if len(swapped) > 1 else swapped[0]]


def per_call_us(fn: Callable[[], object], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    made: dict[type, type] = {}
    print(f"{'body':22} {'bytes':>6} {'orjson.loads':>13} {'msgspec':>9} {'pydantic':>9} "
          f"{'zpd parse':>10}   (us per body)")
    for name, raw, model, parse in CASES:
        twin = as_pydantic(model, made)
        sides = (lambda: orjson.loads(raw),
                 lambda: msgspec.convert(orjson.loads(raw), model, strict=True),
                 lambda: twin.model_validate(orjson.loads(raw)),
                 lambda: parse(orjson.loads(raw)))
        us = [per_call_us(side, args.calls, args.rounds) for side in sides]
        print(f"{name:22} {len(raw):6} {us[0]:13.1f} {us[1]:9.1f} {us[2]:9.1f} {us[3]:10.1f}")


if __name__ == "__main__":
    main()
