"""What the HTTP front spends serializing one streamed /generate request's events:
SGLang's default cumulative events (each carries every token and logprob so far) and
--incremental-streaming-output (each carries only the new ones). Modes:

  before       one cumulative event per token, every logprob formatted again for
               each event (the front before issue 30)
  every-token  one cumulative event per token, logprobs formatted once
  spaced       cumulative events spaced by --cumulative-bytes-per-token (the default)
  incremental  --incremental-streaming-output
  fragments    one cumulative event per token as the route writes it (NativeEvents):
               without logprobs, from the request's JSON fragments (issue 47); with
               logprobs, as every-token

    python bench/bench_sse_events.py [--tokens 4000] [--top 20] [--rounds 3]
                                     [--budget 8192] [--modes before,spaced] [--smoke]
                                     [--no-logprobs]

In-process, no server: one Output fed one token per chunk, with its logprob and
`--top` alternatives, each event formatted as the route does (native_answer or
native_delta, then orjson) — what a front pays per stream when it keeps up with the
decode. Prints events written, per event (mean and last) and for the whole request:
milliseconds of CPU and bytes written, the best of --rounds.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))     # the repository

from engines.models.tiny import tiny_tokenizer  # noqa: E402
from engines.sampling_params import SamplingParams
from zpd.http.native_format import (CumulativeEvents, NativeEvents, native_answer,  # noqa: E402
                                     native_delta)
from zpd.http.output import Output  # noqa: E402
from zpd.http.records import GenRequest  # noqa: E402


def chunk(i: int, token: int, top: int, last: bool) -> dict:
    c = {"rid": "r", "token_ids": [token], "weight_versions": ["v1"], "finished": last}
    if top >= 0:
        c |= {"logprobs": [-0.25], "top_logprobs": [[[token + k, -0.25 - k] for k in range(top)]]}
    if last:
        c |= {"finish_reason": {"type": "length"}, "meta": {"completion_tokens": i + 1},
              "text": None}
    return c


def one_request(tokens: int, top: int, mode: str, budget: int) -> tuple[list[float], list[int]]:
    """Seconds and bytes of each event written (formatting and serializing only)."""
    asks = {"return_logprob": True, "top_logprobs_num": top} if top >= 0 else {}
    req = GenRequest(SamplingParams.from_dict(asks), input_ids=[1], stream=True)
    out = Output(0, req, tiny_tokenizer())
    # every-token: the route's cumulative events with a budget that makes each due
    cumulative = CumulativeEvents(budget if mode == "spaced" else 1 << 62)
    events = NativeEvents(False, cumulative)
    times, sizes = [], []
    for i in range(tokens):
        out.add(chunk(i, 65 + i % 26, top, i == tokens - 1))
        t0 = time.perf_counter()
        if mode == "fragments":
            data = events.render(out)           # serialized, and counted as sent
            times.append(time.perf_counter() - t0)
            sizes.append(len(data))
            continue
        if mode == "incremental":
            answer = native_delta(out)
        elif mode == "before":
            answer = native_answer(out)
        else:
            answer = cumulative.answer(out)
        if answer is None:
            continue
        data = b"data: " + orjson.dumps(answer) + b"\n\n"
        cumulative.sent(out, len(data))
        times.append(time.perf_counter() - t0)
        sizes.append(len(data))
    return times, sizes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=int, default=8192, help="--cumulative-bytes-per-token")
    ap.add_argument("--modes", default="before,every-token,spaced,incremental,fragments")
    ap.add_argument("--no-logprobs", action="store_true", help="requests without logprobs")
    ap.add_argument("--smoke", action="store_true", help="200 tokens, one round")
    args = ap.parse_args()
    if args.smoke:
        args.tokens, args.rounds = 200, 1
    if args.no_logprobs:
        args.top = -1
    print(f"{args.tokens} tokens, " + (f"top-{args.top} logprobs" if args.top >= 0 else
                                        "no logprobs") + ", one chunk per token")
    print(f"{'mode':<12} {'events':>7} {'ms/event':>9} {'last ms':>8} {'total ms':>9} "
          f"{'MB sent':>8}")
    for mode in args.modes.split(","):
        best = min((one_request(args.tokens, args.top, mode, args.budget)
                    for _ in range(args.rounds)), key=lambda r: sum(r[0]))
        times, sizes = best
        print(f"{mode:<12} {len(times):>7} {1e3 * sum(times) / len(times):>9.3f} "
              f"{1e3 * times[-1]:>8.3f} {1e3 * sum(times):>9.0f} {sum(sizes) / 1e6:>8.1f}")


if __name__ == "__main__":
    main()
