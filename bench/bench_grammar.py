"""What constrained decoding costs a decode step: batch 16 with and without a JSON schema.

    python bench/bench_grammar.py [--model smollm2] [--batch 16] [--steps 24] [--repeats 3]

The engine's own decode loop (engines/compute.py, what a decode worker runs), on one
process: --batch requests with the same prompt are prefilled, then --steps decode steps
are timed, all greedy, once plain and once each under the JSON schema below (a record
with a long free string, so every step of the measured window is inside the grammar,
and the mask of a string, the widest one, is computed most steps). Both sides run in
turns, --repeats times; the figures are medians per step. The grammar's own share is
timed apart: filling the batch's masks (llguidance, engines/grammar_mask.py) and
following the sampled tokens. Also: building the tokenizer's llguidance form (once per
worker), compiling the schema (once per distinct schema; cached) and one request's
first mask.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import med  # noqa: E402
from engines.grammar import Grammars  # noqa: E402
from engines.grammar_mask import MaskMaker  # noqa: E402
from engines.loader import load_model  # noqa: E402
from engines.offline import OfflineEngine  # noqa: E402
from engines.request import Request  # noqa: E402
from engines.sampling_params import SamplingParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"enum": ["Paris", "Berlin", "Madrid", "Rome"]},
    "notes": {"type": "string", "minLength": 2000},
    "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "notes", "tags"], "additionalProperties": False}
PROMPT = "Write a JSON record describing a person: name, age, city, long notes and tags.\n"


class Timed:
    """Wraps a callable and keeps the seconds of each call."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, []

    def __call__(self, *args, **kw):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kw)
        finally:
            self.seconds.append(time.perf_counter() - start)


def run(engine: OfflineEngine, prompt: list[int], batch: int, steps: int, schema: str | None
        ) -> tuple[list[float], list[float], list[float], list[float]]:
    """Seconds of each decode step, of each step's sampling (with the mask applied), of
    each step's masks (filled for the batch) and of its end checks (each request's
    matcher following its new token, then the stop checks)."""
    params = SamplingParams(temperature=0, max_new_tokens=steps + 8, ignore_eos=True,
                            json_schema=schema)
    reqs = [Request(f"r{i}", prompt, params) for i in range(batch)]
    compute = engine.compute
    for r in reqs:
        r.pages = engine.pool.allocator.alloc(engine.pool.pages_for(r.max_context))
    compute.prefill(reqs)
    grammar, sampler, ends = Timed(compute._allowed), Timed(compute.sampler.sample), Timed(compute.finished)
    compute._allowed, compute.sampler.sample, compute.finished = grammar, sampler, ends
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            compute.decode(reqs)
            times.append(time.perf_counter() - start)
            assert not any(r.finished for r in reqs), "a request ended inside the window"
    finally:
        del compute._allowed, compute.sampler.sample, compute.finished
        for r in reqs:
            engine.pool.allocator.free_pages(r.pages)
    per_step = [sum(ends.seconds[i:i + batch]) for i in range(0, len(ends.seconds), batch)]
    return times, sampler.seconds, grammar.seconds if schema else [0.0], per_step[-steps:]


def once_costs(model, schema: str) -> dict[str, float]:
    """Milliseconds of the one-off work: the tokenizer's llguidance form, the schema's
    compile, a request's matcher copy and its first mask."""
    cfg = model.cfg
    grammars = Grammars(model.tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids or ()))
    c = SamplingParams(json_schema=schema).constraint
    t0 = time.perf_counter()
    grammars._tokenizer()
    t1 = time.perf_counter()
    grammars.compile(c)
    t2 = time.perf_counter()
    m = grammars.matcher(c)
    t3 = time.perf_counter()
    MaskMaker(cfg.vocab_size)([m], torch.device("cpu"))
    t4 = time.perf_counter()
    return {"tokenizer": t1 - t0, "compile": t2 - t1, "matcher copy": t3 - t2, "first mask": t4 - t3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype)
    schema = json.dumps(SCHEMA)
    prompt = model.encode(PROMPT)
    engine = OfflineEngine(model, kv_cache_mb=64)
    print(f"{args.model} ({model.cfg.vocab_size} tokens, {args.dtype}), batch {args.batch}, "
          f"{args.steps} steps x {args.repeats}, {args.threads} torch threads")
    for name, secs in once_costs(model, schema).items():
        print(f"once: {name:<13} {secs * 1e3:8.2f} ms")
    run(engine, prompt, args.batch, 2, schema)           # warm both paths
    run(engine, prompt, args.batch, 2, None)
    sides = {"plain": None, "json schema": schema}
    got = {name: ([], [], [], []) for name in sides}
    for _ in range(args.repeats):                 # in turns: the machine's noise falls on both
        for name, text in sides.items():
            for kept, new in zip(got[name], run(engine, prompt, args.batch, args.steps, text)):
                kept += new
    ms = {name: [med(x) * 1e3 for x in lists] for name, lists in got.items()}
    print(f"{'median ms per decode step':<28} {'plain':>8} {'json schema':>12}")
    for i, row in enumerate(("whole step", "sampling (with the mask)", "masks filled",
                             "end checks (with follow)")):
        print(f"{row:<28} {ms['plain'][i]:8.2f} {ms['json schema'][i]:12.2f}")
    (p, ps, _, pe), (c, cs, g, ce) = ms["plain"], ms["json schema"]
    share = g + cs - ps + ce - pe
    print(f"grammar's share of the constrained step: {share / c * 100:.1f}% (masks "
          f"{g / c * 100:.1f}%, applying them {(cs - ps) / c * 100:.1f}%, following the tokens "
          f"{(ce - pe) / c * 100:.1f}%); {share / args.batch * 1e3:.0f} us per request")
    print(f"ratio constrained/plain: {c / p:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
